"""Checks on each request, run in the caller's process before anything reaches the engine,
so a bad request is a ValueError naming the field and the limit and touches no other one."""
from __future__ import annotations

from ray_runtime.sampling_params import SamplingParams


def validate_request(index: int, token_ids: list[int], sp: SamplingParams, *, vocab_size: int,
                     max_model_len: int, num_kv_blocks: int, block_size: int,
                     num_lookahead: int = 0) -> None:
    where = f"prompt {index}"
    if not isinstance(sp, SamplingParams):
        raise ValueError(f"sampling_params for {where} must be a SamplingParams, got {type(sp).__name__}")
    sp.validate()  # fields may have been changed after construction
    if len(token_ids) == 0:
        raise ValueError(f"{where}: prompt is empty (prompt_token_ids must hold at least 1 token)")
    bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{where}: prompt_token_ids {bad[:5]} outside the vocabulary "
                         f"[0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise ValueError(f"{where}: prompt has {len(token_ids)} tokens, which leaves no room to "
                         f"generate within max_model_len={max_model_len}")
    # With speculative decoding a step also reserves KV slots for the drafts after it.
    longest = min(len(token_ids) + sp.max_tokens + num_lookahead, max_model_len)
    if -(-longest // block_size) > num_kv_blocks:
        raise ValueError(f"{where}: {longest} tokens (prompt + max_tokens + drafts) need "
                         f"{-(-longest // block_size)} KV blocks, more than num_kv_blocks="
                         f"{num_kv_blocks} of {block_size} tokens")
