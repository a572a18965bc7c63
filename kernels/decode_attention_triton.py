"""Paged attention for decode rows as a Triton kernel: one program per (row, kv head),
online softmax over the row's KV blocks, every query head of the GQA group at once.

Oracle: `kernels.paged_attention.paged_attention_ref` (and `decode_attention_batched`).
On CPU it runs under TRITON_INTERPRET=1 (the tests); on CUDA it is the decode path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, scale,
        stride_q_row, stride_q_head, stride_o_row, stride_o_head,
        stride_kv_block, stride_kv_slot, stride_kv_head, stride_bt_row,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + row)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    heads = kv_head * GROUP + g
    in_group = g < GROUP
    q = tl.load(q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + d[None, :],
                mask=in_group[:, None], other=0.0).to(tl.float32)  # [GROUP_PAD, HEAD_DIM]
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for b in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        block_id = tl.load(block_tables_ptr + row * stride_bt_row + b).to(tl.int64)
        valid = b * BLOCK_SIZE + s < seq_len
        offs = block_id * stride_kv_block + s[:, None] * stride_kv_slot \
            + kv_head * stride_kv_head + d[None, :]
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, BLOCK_SIZE]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(out_ptr + row * stride_o_row + heads[:, None] * stride_o_head + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=in_group[:, None])


def check_paged_shapes(query: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor) -> tuple[int, int, int, int, int]:
    """The checks both paged-attention launchers share: query [tokens, heads, head_dim] and
    caches [num_blocks, block_size, kv_heads, head_dim] that fit each other, GQA groups,
    power-of-two head_dim and block_size. Returns (tokens, heads, head_dim, block_size,
    kv_heads)."""
    tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, kv_dim = key_cache.shape
    if kv_dim != head_dim or value_cache.shape != key_cache.shape:
        raise ValueError(f"cache shapes {tuple(key_cache.shape)} / {tuple(value_cache.shape)} "
                         f"do not fit query head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    for name, n in (("head_dim", head_dim), ("block_size", block_size)):
        if n & (n - 1):
            raise ValueError(f"{name} must be a power of two, got {n}")
    return tokens, num_heads, head_dim, block_size, num_kv_heads


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """query: [rows, heads, head_dim], one decode token per row at the end of its context;
    key/value_cache: [num_blocks, block_size, kv_heads, head_dim]; block_tables:
    [rows, >= max blocks]; seq_lens: [rows] context lengths (>= 1)."""
    rows, num_heads, head_dim, block_size, num_kv_heads = check_paged_shapes(
        query, key_cache, value_cache)
    if block_tables.shape[0] != rows or seq_lens.shape != (rows,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / seq_lens "
                         f"{tuple(seq_lens.shape)} do not match {rows} rows")
    if query.stride(-1) != 1 or key_cache.stride(-1) != 1 or value_cache.stride() != key_cache.stride():
        raise ValueError("query and caches need a contiguous last dimension and equal cache strides")
    out = torch.empty_like(query)
    if rows == 0:
        return out
    group = num_heads // num_kv_heads
    _paged_decode_attention_kernel[(rows, num_kv_heads)](
        out, query, key_cache, value_cache, block_tables, seq_lens, scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size)
    return out
