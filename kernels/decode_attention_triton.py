"""Paged attention for decode rows as a Triton kernel (flash-decoding): one program per
(row, kv head, split of the row's context). A program walks its split in tiles of BLOCK_N
tokens, gathered through the block table (several KV blocks per tile), and keeps an online
softmax for every query head of the GQA group at once (padded to 16 rows for tensor-core
dots). With one split it writes the output; with several, each split writes its partial
(unnormalized accumulator, max, sum) and a second kernel merges them.

Splits exist for small batches: rows x kv_heads programs alone would leave most SMs idle.
The count depends on the number of rows only (not on context lengths, which live on the
device), so a CUDA graph captured for a batch size keeps its split count.

Oracle: `kernels.paged_attention.paged_attention_ref` (and `decode_attention_batched`).
On CPU it runs under TRITON_INTERPRET=1 (the tests); on CUDA it is the decode path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # context tokens per tile
MAX_SPLITS = 32


@triton.jit
def _paged_decode_attention_kernel(
        out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
        block_tables_ptr, seq_lens_ptr, scale, num_splits,
        stride_q_row, stride_q_head, stride_o_row, stride_o_head,
        stride_kv_block, stride_kv_slot, stride_kv_head, stride_bt_row,
        NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr, SPLIT: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(num_tiles, num_splits)
    t_begin = split * per_split
    t_end = tl.minimum(num_tiles, t_begin + per_split)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + g
    in_group = g < GROUP
    q = tl.load(q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + d[None, :],
                mask=in_group[:, None], other=0.0)  # [GROUP_PAD, HEAD_DIM]
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for t in range(t_begin, t_end):  # every tile holds at least one token of the context
        pos = t * BLOCK_N + n
        valid = pos < seq_len
        block_id = tl.load(block_tables_ptr + row * stride_bt_row + pos // BLOCK_SIZE,
                           mask=valid, other=0).to(tl.int64)
        offs = block_id[:, None] * stride_kv_block + (pos % BLOCK_SIZE)[:, None] * stride_kv_slot \
            + kv_head * stride_kv_head + d[None, :]
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [GROUP_PAD, BLOCK_N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    if SPLIT:  # partials: [rows, heads, splits(, head_dim)]
        part = (row * NUM_HEADS + heads) * num_splits + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=in_group[:, None])
        tl.store(part_m_ptr + part, m, mask=in_group)
        tl.store(part_l_ptr + part, l_sum, mask=in_group)
    else:
        out = acc / l_sum[:, None]
        tl.store(out_ptr + row * stride_o_row + heads[:, None] * stride_o_head + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=in_group[:, None])


@triton.jit
def _merge_splits_kernel(out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, num_splits,
                         stride_o_row, stride_o_head, NUM_HEADS: tl.constexpr,
                         HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    used = s < num_splits
    part = (row * NUM_HEADS + head) * num_splits + s
    m = tl.load(part_m_ptr + part, mask=used, other=float("-inf"))
    l_sum = tl.load(part_l_ptr + part, mask=used, other=0.0)
    m_all = tl.max(m, axis=0)  # finite: split 0 always holds the first tile
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))  # empty splits weigh nothing
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=used[:, None], other=0.0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l_sum, axis=0)
    tl.store(out_ptr + row * stride_o_row + head * stride_o_head + d, out.to(out_ptr.dtype.element_ty))


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
    if head_dim < 16:
        raise ValueError(f"head_dim must be >= 16 (tensor-core tiles), got {head_dim}")
    return tokens, num_heads, head_dim, block_size, num_kv_heads


def dot_precision(dtype: torch.dtype) -> str:
    """float32 models get exact float32 dots (never TF32); half types use tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def default_num_splits(rows: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Enough programs for about two waves over the SMs, never more splits than tiles."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    want = -(-2 * sms // max(1, rows * num_kv_heads))
    return max(1, min(MAX_SPLITS, want, -(-max_context // BLOCK_N)))


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None) -> torch.Tensor:
    """query: [rows, heads, head_dim], one decode token per row at the end of its context;
    key/value_cache: [num_blocks, block_size, kv_heads, head_dim]; block_tables:
    [rows, >= max blocks]; seq_lens: [rows] context lengths (>= 1). num_splits: how many
    programs share a row's context (None: default_num_splits)."""
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
    seq_lens = seq_lens.contiguous()  # read as seq_lens_ptr + row
    if num_splits is None:
        num_splits = default_num_splits(rows, num_kv_heads, block_tables.shape[1] * block_size,
                                        query.device)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    group = num_heads // num_kv_heads
    split = num_splits > 1
    dev = query.device
    part_acc = torch.empty(rows * num_heads * num_splits * head_dim if split else 1,
                           dtype=torch.float32, device=dev)
    part_m = torch.empty(rows * num_heads * num_splits if split else 1, dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    _paged_decode_attention_kernel[(rows, num_kv_heads, num_splits)](
        out, part_acc, part_m, part_l, query, key_cache, value_cache, block_tables, seq_lens,
        scale, num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N,
        PRECISION=dot_precision(query.dtype), SPLIT=split)
    if split:
        _merge_splits_kernel[(rows, num_heads)](
            out, part_acc, part_m, part_l, num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, SPLITS_PAD=triton.next_power_of_2(num_splits))
    return out
