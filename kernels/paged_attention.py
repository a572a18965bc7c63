"""Paged attention for mixed prefill/decode batches, and the KV-cache write.

Layout, per layer: key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim].
A step's tokens are laid out request by request; request i owns query rows
[query_start_loc[i], query_start_loc[i+1]) at the last positions of its context of
seq_lens[i] tokens, so a prefill chunk attends to its cached prefix and causally within
itself, and a decode row is a chunk of one.

These are the torch references: the CPU path, and the oracle for the Triton kernels of the
GPU issue, which will plug in behind the same two functions.
"""
from __future__ import annotations

import torch


def write_kv_ref(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] flat slots."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: list[int],
                        query_start_loc: list[int], scale: float) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim].
    block_tables: [num_reqs, max_blocks]; seq_lens, query_start_loc: host lists."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for i, ctx_len in enumerate(seq_lens):
        q_start, q_end = query_start_loc[i], query_start_loc[i + 1]
        q_len = q_end - q_start
        num_blocks = -(-ctx_len // block_size)
        blocks = block_tables[i, :num_blocks]
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len]
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len]
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].transpose(0, 1)  # [heads, q_len, head_dim]
        scores = torch.matmul(q, k.permute(1, 2, 0)) * scale  # [heads, q_len, ctx_len]
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
        k_pos = torch.arange(ctx_len, device=query.device)
        scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out[q_start:q_end] = torch.matmul(probs, v.transpose(0, 1)).transpose(0, 1)
    return out


def write_kv(key_cache, value_cache, key, value, slot_mapping) -> None:
    write_kv_ref(key_cache, value_cache, key, value, slot_mapping)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                    scale) -> torch.Tensor:
    return paged_attention_ref(query, key_cache, value_cache, block_tables, seq_lens,
                               query_start_loc, scale)
