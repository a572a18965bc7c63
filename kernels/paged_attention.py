"""Paged attention for mixed prefill/decode batches, and the KV-cache write.

Layout, per layer: key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim].
A step's tokens are laid out request by request; request i owns query rows
[query_start_loc[i], query_start_loc[i+1]) at the last positions of its context of
seq_lens[i] tokens, so a prefill chunk attends to its cached prefix and causally within
itself, and a decode row is a chunk of one.

`*_ref` are the torch references: the oracle for the Triton kernels, which plug in behind
`paged_attention` on CUDA: every decode row (and every chunk of up to SHORT_CHUNK tokens, as
decode rows) in one launch of decode_attention_triton.py, every longer chunk in one launch of
prefill_attention_triton.py. On CPU: a batched gather for the decode rows, the reference
one request at a time for the chunks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
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


def decode_attention_batched(query: torch.Tensor, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, block_tables: torch.Tensor,
                             seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode rows only (one query token each, at the end of its context), all at once:
    gather every row's blocks, mask past each context. query: [rows, heads, head_dim];
    block_tables: [rows, >= max blocks]; seq_lens: [rows] tensor."""
    rows, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    max_ctx = int(seq_lens.max())
    num_blocks = -(-max_ctx // block_size)
    tables = block_tables[:, :num_blocks]
    k = key_cache[tables].reshape(rows, num_blocks * block_size, num_kv_heads, head_dim)[:, :max_ctx]
    v = value_cache[tables].reshape(rows, num_blocks * block_size, num_kv_heads, head_dim)[:, :max_ctx]
    past_end = torch.arange(max_ctx, device=query.device)[None, :] >= seq_lens[:, None]  # [rows, ctx]
    v = v.masked_fill(past_end[:, :, None, None], 0.0)  # slots past a context may hold anything
    q = query.view(rows, num_kv_heads, group, head_dim)
    scores = torch.einsum("rkgd,rlkd->rkgl", q, k) * scale
    scores = scores.masked_fill(past_end[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.einsum("rkgl,rlkd->rkgd", probs, v).reshape(rows, num_heads, head_dim)


def _decode_rows(query, key_cache, value_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    """Triton on CUDA; the batched torch gather on CPU (and as the Triton kernel's oracle)."""
    if query.is_cuda:
        from kernels.decode_attention_triton import paged_decode_attention

        return paged_decode_attention(query, key_cache, value_cache, block_tables,  # strided ok
                                      seq_lens, scale)
    return decode_attention_batched(query, key_cache, value_cache, block_tables, seq_lens, scale)


def write_kv(key_cache, value_cache, key, value, slot_mapping) -> None:
    if key.is_cuda:
        from kernels.layer_ops_triton import write_kv_triton

        write_kv_triton(key_cache, value_cache, key, value, slot_mapping)
        return
    write_kv_ref(key_cache, value_cache, key, value, slot_mapping)


# A chunk this short runs as decode rows, one per query token, each attending to its own
# causal prefix: verification steps of speculative decoding (1 + k tokens) batch with decodes.
SHORT_CHUNK = 16


@dataclass
class DecodeLayout:
    """Which query rows of a step run as decode rows: the token rows, the request (block
    table row) of each, and each one's causal context length; the rest are long chunks."""

    token_rows: torch.Tensor
    table_rows: torch.Tensor
    ctx_lens: torch.Tensor
    long_chunks: list[int]
    all_decode: bool  # every request is a single decode token, in order
    # CUDA: prefill_tile_arrays() of the long chunks on the device, staged with the step's
    # inputs (None: the prefill kernel builds them itself, with a synchronous copy per call)
    prefill_tiles: Optional[tuple[torch.Tensor, ...]] = None


PREFILL_BLOCK_M = 32  # query tokens per tile of the prefill kernel


def prefill_tile_arrays(seq_lens, query_start_loc, requests,
                        block_m: int = PREFILL_BLOCK_M) -> list[np.ndarray]:
    """The prefill kernel's launch metadata for the long chunks `requests`, as int64 host
    arrays: each tile's request and first query row (tiles of block_m query tokens), and per
    request its first query row, query length and context length. A step computes them once
    and stages them with its other inputs (one pinned copy), so no layer's launch copies from
    host memory (such a copy makes the host wait until the device has caught up)."""
    qsl = np.asarray(query_start_loc, np.int64)
    ctx = np.asarray(seq_lens, np.int64)
    q_len = np.diff(qsl)
    req = np.asarray(requests, np.int64)
    bad = np.nonzero((q_len[req] <= 0) | (q_len[req] > ctx[req]))[0]
    if len(bad):
        i = int(req[bad[0]])
        raise ValueError(f"request {i}: chunk of {int(q_len[i])} tokens in a context of "
                         f"{int(ctx[i])}")
    per = -(-q_len[req] // block_m)
    first = np.repeat(np.cumsum(per) - per, per)
    tile_m0 = (np.arange(int(per.sum()), dtype=np.int64) - first) * block_m
    return [np.repeat(req, per), tile_m0, qsl[:-1], q_len, ctx]


def decode_layout_arrays(seq_lens, query_start_loc) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                             list[int], bool]:
    """seq_lens [requests] and query_start_loc [requests + 1] (lists or arrays): every token
    of a chunk of up to SHORT_CHUNK tokens becomes a decode row whose causal context ends at
    its own position. Host arrays (token_rows, table_rows, ctx_lens), long_chunks, all_decode."""
    ctx = np.asarray(seq_lens, np.int64)
    qsl = np.asarray(query_start_loc, np.int64)
    n = np.diff(qsl)
    if len(n) and (n == 1).all():  # a decode step: token i is request i's one row
        each = np.arange(len(n))  # returned twice and ctx itself: read-only downstream
        return each, each, ctx, [], True
    short = n <= SHORT_CHUNK
    req = np.repeat(np.arange(len(n)), n)  # each token's request
    position = np.arange(qsl[-1]) - qsl[:-1][req] + (ctx - n)[req]
    decode = short[req]
    token_rows = np.nonzero(decode)[0]
    long_chunks = np.nonzero(~short)[0].tolist()
    all_decode = len(token_rows) == len(n) and not long_chunks
    return token_rows, req[decode], position[decode] + 1, long_chunks, all_decode


def decode_layout(seq_lens, query_start_loc, device) -> DecodeLayout:
    token_rows, table_rows, ctx_lens, long_chunks, all_decode = \
        decode_layout_arrays(seq_lens, query_start_loc)

    def t(x):
        return torch.from_numpy(np.ascontiguousarray(x, np.int64)).to(device)

    return DecodeLayout(t(token_rows), t(table_rows), t(ctx_lens), long_chunks, all_decode)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                    scale, layout: Optional[DecodeLayout] = None) -> torch.Tensor:
    """Short chunks and decode rows in one batched decode pass; long prefill chunks one
    request at a time. `layout`: decode_layout() of this step, computed once for all layers."""
    if layout is None:
        layout = decode_layout(seq_lens, query_start_loc, query.device)
    if query.is_cuda:  # Triton: one launch for the decode rows, one for the long chunks
        if layout.all_decode:
            return _decode_rows(query, key_cache, value_cache, block_tables, layout.ctx_lens, scale)
        from kernels.prefill_attention_triton import prefill_attention

        query = query.contiguous()
        out = torch.empty_like(query)
        if len(layout.token_rows):
            out[layout.token_rows] = _decode_rows(
                query.index_select(0, layout.token_rows), key_cache, value_cache,
                block_tables.index_select(0, layout.table_rows), layout.ctx_lens, scale)
        prefill_attention(query, key_cache, value_cache, block_tables, seq_lens,
                          query_start_loc, layout.long_chunks, out, scale,
                          tiles=layout.prefill_tiles)
        return out
    if len(layout.token_rows) < 2:
        return paged_attention_ref(query, key_cache, value_cache, block_tables, seq_lens,
                                   query_start_loc, scale)
    if layout.all_decode:
        return _decode_rows(query, key_cache, value_cache, block_tables, layout.ctx_lens, scale)
    out = torch.empty_like(query)
    out[layout.token_rows] = _decode_rows(
        query.index_select(0, layout.token_rows), key_cache, value_cache,
        block_tables.index_select(0, layout.table_rows), layout.ctx_lens, scale)
    for i in layout.long_chunks:
        a, b = query_start_loc[i], query_start_loc[i + 1]
        out[a:b] = paged_attention_ref(query[a:b], key_cache, value_cache, block_tables[i:i + 1],
                                       [seq_lens[i]], [0, b - a], scale)
    return out
