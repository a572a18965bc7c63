"""Paged attention for prefill chunks as a Triton kernel: each chunk's queries attend to the
request's cached prefix and causally within the chunk, reading K/V through the block table.

One program per (tile of BLOCK_M query tokens of one request, query head), online softmax
over the request's KV blocks up to the tile's last position. Oracle:
`kernels.paged_attention.paged_attention_ref`. On CPU it runs under TRITON_INTERPRET=1 (the
tests); on CUDA it is the path for chunks longer than SHORT_CHUNK.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.decode_attention_triton import check_paged_shapes, dot_precision
from kernels.paged_attention import PREFILL_BLOCK_M, prefill_tile_arrays


@triton.jit
def _prefill_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
        tile_req_ptr, tile_m0_ptr, q_start_ptr, q_len_ptr, ctx_len_ptr, scale,
        stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
        stride_kv_block, stride_kv_slot, stride_kv_head, stride_bt_row,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    req = tl.load(tile_req_ptr + tile)
    m0 = tl.load(tile_m0_ptr + tile)
    q_start = tl.load(q_start_ptr + req)
    q_len = tl.load(q_len_ptr + req)
    ctx = tl.load(ctx_len_ptr + req)
    m = m0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    valid_q = m < q_len
    q_pos = ctx - q_len + m  # absolute positions of this tile's queries
    q = tl.load(q_ptr + (q_start + m)[:, None] * stride_q_tok + head * stride_q_head + d[None, :],
                mask=valid_q[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    last_pos = tl.minimum(ctx - q_len + m0 + BLOCK_M, ctx)  # keys [0, last_pos) can matter
    for b in range(0, tl.cdiv(last_pos, BLOCK_SIZE)):
        block_id = tl.load(block_tables_ptr + req * stride_bt_row + b).to(tl.int64)
        k_pos = b * BLOCK_SIZE + s
        offs = block_id * stride_kv_block + s[:, None] * stride_kv_slot \
            + kv_head * stride_kv_head + d[None, :]
        in_ctx = k_pos < ctx
        k = tl.load(k_cache_ptr + offs, mask=in_ctx[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=in_ctx[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale  # [BLOCK_M, BLOCK_SIZE]
        allowed = (k_pos[None, :] <= q_pos[:, None]) & in_ctx[None, :]
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing allowed yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + m)[:, None] * stride_o_tok + head * stride_o_head + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=valid_q[:, None])


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: list[int], query_start_loc: list[int],
                      requests: list[int], out: torch.Tensor, scale: float,
                      block_m: int = PREFILL_BLOCK_M, tiles=None) -> None:
    """Writes out[rows of `requests`]: query [num_tokens, heads, head_dim]; caches
    [num_blocks, block_size, kv_heads, head_dim]; block_tables [num_reqs, >= blocks];
    seq_lens / query_start_loc as in paged_attention_ref. Requests not listed are untouched.
    tiles: prefill_tile_arrays() of the same arguments, already on the device (a step's
    layout carries them); without them they are built and copied here."""
    _, num_heads, head_dim, block_size, num_kv_heads = check_paged_shapes(
        query, key_cache, value_cache)
    if out.shape != query.shape or query.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("query and out must have the same shape and a contiguous last dim")
    if not requests:
        return
    if tiles is None:
        tiles = [torch.from_numpy(a).to(query.device)
                 for a in prefill_tile_arrays(seq_lens, query_start_loc, requests, block_m)]
    elif block_m != PREFILL_BLOCK_M:
        raise ValueError(f"block_m: staged tiles are of {PREFILL_BLOCK_M} tokens, not {block_m}")
    tile_req, tile_m0, q_start, q_len, ctx_len = tiles
    grid = (tile_req.shape[0], num_heads)
    _prefill_attention_kernel[grid](
        out, query, key_cache, value_cache, block_tables, tile_req, tile_m0, q_start,
        q_len, ctx_len, scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=block_m,
        BLOCK_SIZE=block_size, PRECISION=dot_precision(query.dtype))
