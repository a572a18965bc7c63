"""Checks on generate()'s arguments and on each request, run in the caller's process before
anything reaches the engine, so that a bad request is a ValueError (an InputTypeError, also a
TypeError, for a wrong type) naming the argument or field and the limit, and touches no other
one. What passes is converted to the plain types the wire format carries."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ray_runtime.checks import InputTypeError, as_int_list, show
from ray_runtime.sampling_params import SamplingParams

PROMPT_KEYS = ("prompt", "prompt_token_ids")
_PROMPTS_DOC = ("a str, a dict with 'prompt' and/or 'prompt_token_ids', or a list of strs, "
                "such dicts and token-id lists")


def as_prompt_list(prompts) -> list:
    """generate()'s `prompts` as a list of single prompts (see parse_prompt)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise InputTypeError(f"prompts must be {_PROMPTS_DOC}, got {show(prompts)}")


def parse_prompt(index: int, prompt) -> tuple[Optional[str], Optional[Sequence]]:
    """One prompt -> (text, token_ids): token_ids None means the text is still to tokenize.
    A str, a token-id list (list, tuple, 1-D numpy array) or a dict of PROMPT_KEYS."""
    where = f"prompts[{index}]"
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, (list, tuple, np.ndarray)):
        return None, prompt
    if not isinstance(prompt, dict):
        raise InputTypeError(f"{where} must be a str, a dict with 'prompt' and/or "
                             f"'prompt_token_ids' or a list of token ids, got {show(prompt)}")
    unknown = [k for k in prompt if k not in PROMPT_KEYS]
    if unknown or not prompt:
        raise ValueError(f"{where}: a dict prompt takes 'prompt' and/or 'prompt_token_ids', "
                         f"got keys {list(prompt)}")
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise InputTypeError(f"{where}['prompt'] must be a str, got {show(text)}")
    if "prompt_token_ids" not in prompt:
        if text is None:
            raise InputTypeError(f"{where}['prompt'] must be a str, got None")
        return text, None
    ids = prompt["prompt_token_ids"]
    if not isinstance(ids, (list, tuple, np.ndarray)):
        raise InputTypeError(f"{where}['prompt_token_ids'] must be a list of token ids, "
                             f"got {show(ids)}")
    return text, ids


def as_params_list(sampling_params, num_prompts: int) -> list:
    """generate()'s `sampling_params` as one entry per prompt (each checked by validate_request)."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if not isinstance(sampling_params, (list, tuple)):
        raise InputTypeError(f"sampling_params must be a SamplingParams, a list of one per "
                             f"prompt or None, got {show(sampling_params)}")
    if len(sampling_params) != num_prompts:
        raise ValueError(f"sampling_params has {len(sampling_params)} entries for "
                         f"{num_prompts} prompts")
    return list(sampling_params)


def validate_request(index: int, token_ids: Sequence[int], sp: SamplingParams, *,
                     vocab_size: int, max_model_len: int, num_kv_blocks: int, block_size: int,
                     num_lookahead: int = 0, check_params: bool = True) -> list[int]:
    """Check request `index` against the engine's limits; returns its prompt token ids as a
    list of plain ints (the sampling params are converted in place; check_params=False: the
    same object was checked for an earlier request of this call)."""
    where = f"prompts[{index}]"
    if not isinstance(sp, SamplingParams):
        raise InputTypeError(f"sampling_params[{index}] must be a SamplingParams, got {show(sp)}")
    if check_params:
        sp.validate()  # fields may have been changed after construction
    vocab = f"the vocabulary [0, {vocab_size})"
    token_ids = as_int_list(token_ids, f"{where}: prompt_token_ids", 0, vocab_size - 1, vocab)
    if len(token_ids) == 0:
        raise ValueError(f"{where}: prompt is empty (prompt_token_ids must hold at least 1 token)")
    as_int_list(sp.stop_token_ids, f"{where}: SamplingParams.stop_token_ids", 0, vocab_size - 1,
                vocab)
    if len(token_ids) >= max_model_len:
        raise ValueError(f"{where}: prompt has {len(token_ids)} tokens, which leaves no room to "
                         f"generate within max_model_len={max_model_len}")
    if sp.max_tokens > max_model_len:
        raise ValueError(f"{where}: SamplingParams.max_tokens={sp.max_tokens} exceeds "
                         f"max_model_len={max_model_len} (prompt and output share the context)")
    # With speculative decoding a step also reserves KV slots for the drafts after it.
    longest = min(len(token_ids) + sp.max_tokens + num_lookahead, max_model_len)
    if -(-longest // block_size) > num_kv_blocks:
        raise ValueError(f"{where}: {longest} tokens (prompt + max_tokens + drafts) need "
                         f"{-(-longest // block_size)} KV blocks, more than num_kv_blocks="
                         f"{num_kv_blocks} of {block_size} tokens")
    return token_ids
