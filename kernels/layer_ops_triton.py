"""Fused elementwise kernels of a decoder layer, as Triton kernels: RMSNorm (optionally
adding the residual first), per-head RMSNorm + rotary embedding in place on q or k, SiLU-and-
multiply, the KV-cache write from a slot mapping, and q's and k's norm + rotary with the KV
write in one launch (`qk_rope_kv_triton_`: a half-precision layer's attention inputs on CUDA).

Each one rounds where transformers' module rounds (to the model dtype after the norm,
after each product of the rotary, after SiLU), so a bf16 model's values match the unfused
torch ops up to float32 summation order. Oracles: the torch references in
`kernels/layer_ops.py`, which are also the CPU path. On CPU they run under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms(xf, n_cols, eps):
    var = tl.sum(xf * xf, axis=0) / n_cols
    return tl.math.div_rn(1.0, tl.sqrt_rn(var + eps))


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # the sum is rounded to the model dtype, as `residual + x` is
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    y = (xf * _rms(xf, n_cols, eps)).to(dt)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * y.to(tl.float32)).to(dt), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None):
    """x [rows, n] -> norm(x) (and, with residual, also x + residual: returns (norm, sum))."""
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm: x {tuple(x.shape)} needs a contiguous last dim of "
                         f"weight's size {tuple(weight.shape)}")
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    r = residual if residual is not None else x
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, r, weight, out, res_out, x.shape[1], eps, x.stride(0), r.stride(0), out.stride(0),
            res_out.stride(0), HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(x.shape[1]))
    return out if residual is None else (out, res_out)


@triton.jit
def _norm_rope_head(base, w_ptr, cos_row, sin_row, eps, HAS_NORM: tl.constexpr,
                    HALF: tl.constexpr):
    """One head at `base`: per-head RMSNorm (HAS_NORM), then the rotary embedding with the
    cos/sin row at cos_row/sin_row. Returns the two halves in the head's dtype."""
    dt = base.dtype.element_ty
    i = tl.arange(0, HALF)
    x1 = tl.load(base + i)
    x2 = tl.load(base + HALF + i)
    if HAS_NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        var = (tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / (2 * HALF)
        r = tl.math.div_rn(1.0, tl.sqrt_rn(var + eps))
        w1 = tl.load(w_ptr + i).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + i).to(tl.float32)
        x1 = (w1 * (f1 * r).to(dt).to(tl.float32)).to(dt)
        x2 = (w2 * (f2 * r).to(dt).to(tl.float32)).to(dt)
    c1 = tl.load(cos_row + i).to(tl.float32)
    c2 = tl.load(cos_row + HALF + i).to(tl.float32)
    s1 = tl.load(sin_row + i).to(tl.float32)
    s2 = tl.load(sin_row + HALF + i).to(tl.float32)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product rounded as the torch ops round it
    o1 = ((f1 * c1).to(dt).to(tl.float32) + (-f2 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((f2 * c2).to(dt).to(tl.float32) + (f1 * s2).to(dt).to(tl.float32)).to(dt)
    return o1, o2


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, eps, stride_tok, stride_head, stride_cs,
                      HAS_NORM: tl.constexpr, HALF: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = x_ptr + tok * stride_tok + head * stride_head
    o1, o2 = _norm_rope_head(base, w_ptr, cos_ptr + tok * stride_cs, sin_ptr + tok * stride_cs,
                             eps, HAS_NORM, HALF)
    i = tl.arange(0, HALF)
    tl.store(base + i, o1)
    tl.store(base + HALF + i, o2)


@triton.jit
def _qk_rope_kv_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr,
                       kc_ptr, vc_ptr, slot_ptr, eps, stride_qt, stride_qh, stride_kt,
                       stride_kh, stride_vt, stride_vh, stride_cs,
                       NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                       HAS_NORM: tl.constexpr, HALF: tl.constexpr):
    """Program (token, head): heads [0, NUM_Q_HEADS) norm and rotate q in place; the next
    NUM_KV_HEADS norm and rotate k and write it, and v, into the caches at the token's slot.
    cos/sin are tables indexed by the token's position."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cos_row, sin_row = cos_ptr + pos * stride_cs, sin_ptr + pos * stride_cs
    i = tl.arange(0, HALF)
    if head < NUM_Q_HEADS:
        base = q_ptr + tok * stride_qt + head * stride_qh
        o1, o2 = _norm_rope_head(base, qw_ptr, cos_row, sin_row, eps, HAS_NORM, HALF)
        tl.store(base + i, o1)
        tl.store(base + HALF + i, o2)
    else:
        kv_head = head - NUM_Q_HEADS
        o1, o2 = _norm_rope_head(k_ptr + tok * stride_kt + kv_head * stride_kh, kw_ptr,
                                 cos_row, sin_row, eps, HAS_NORM, HALF)
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        dst = (slot * NUM_KV_HEADS + kv_head) * (2 * HALF)
        tl.store(kc_ptr + dst + i, o1)
        tl.store(kc_ptr + dst + HALF + i, o2)
        src = v_ptr + tok * stride_vt + kv_head * stride_vh
        tl.store(vc_ptr + dst + i, tl.load(src + i))
        tl.store(vc_ptr + dst + HALF + i, tl.load(src + HALF + i))


def qk_rope_kv_triton_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                       cos_table: torch.Tensor, sin_table: torch.Tensor,
                       positions: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """One launch for what norm_rope_triton_ on q and on k and write_kv_triton do: q
    [tokens, heads, head_dim] normed (per head, when the weights are given) and rotated in
    place; k normed and rotated and v copied into caches [blocks, block_size, kv_heads,
    head_dim] at slot_mapping; cos/sin read from tables [positions, head_dim] at each
    token's position (k itself is left as it was). Returns q."""
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if head_dim % 2 or (head_dim // 2) & (head_dim // 2 - 1) or q.stride(-1) != 1:
        raise ValueError(f"qk_rope_kv: q {tuple(q.shape)} needs a contiguous last dim whose half "
                         "is a power of two")
    if k.shape != (tokens, kv_heads, head_dim) or v.shape != k.shape or k.stride(-1) != 1 \
            or v.stride(-1) != 1:
        raise ValueError(f"qk_rope_kv: k {tuple(k.shape)} / v {tuple(v.shape)} must be "
                         f"[{tokens}, kv_heads, {head_dim}], contiguous in the last dim")
    if key_cache.shape[2:] != (kv_heads, head_dim) or value_cache.shape != key_cache.shape \
            or not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError(f"qk_rope_kv: caches {tuple(key_cache.shape)} must be contiguous "
                         f"[blocks, block_size, {kv_heads}, {head_dim}]")
    if cos_table.dim() != 2 or cos_table.shape[1] != head_dim or sin_table.shape != cos_table.shape \
            or cos_table.stride() != sin_table.stride() or cos_table.stride(-1) != 1:
        raise ValueError(f"qk_rope_kv: cos/sin tables {tuple(cos_table.shape)} must be "
                         f"[positions, {head_dim}], contiguous in the last dim")
    if positions.shape != (tokens,) or slot_mapping.shape != (tokens,):
        raise ValueError(f"qk_rope_kv: positions {tuple(positions.shape)} and slot_mapping "
                         f"{tuple(slot_mapping.shape)} must be [{tokens}]")
    if (q_weight is None) != (k_weight is None) or \
            (q_weight is not None and (q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,))):
        raise ValueError(f"qk_rope_kv: q/k norm weights must both be [{head_dim}] or both None")
    if tokens:
        w_q = q_weight if q_weight is not None else cos_table
        w_k = k_weight if k_weight is not None else cos_table
        _qk_rope_kv_kernel[(tokens, heads + kv_heads)](
            q, k, v, w_q, w_k, cos_table, sin_table, positions.contiguous(), key_cache,
            value_cache, slot_mapping.contiguous(), eps, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), v.stride(0), v.stride(1), cos_table.stride(0), NUM_Q_HEADS=heads,
            NUM_KV_HEADS=kv_heads, HAS_NORM=q_weight is not None, HALF=head_dim // 2)
    return q


def norm_rope_triton_(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                      cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """In place on x [tokens, heads, head_dim]: per-head RMSNorm (when weight is given), then
    the rotary embedding with cos/sin [tokens, head_dim]."""
    tokens, heads, head_dim = x.shape
    if x.stride(-1) != 1 or head_dim % 2 or (head_dim // 2) & (head_dim // 2 - 1):
        raise ValueError(f"norm_rope: x {tuple(x.shape)} needs a contiguous last dim whose half "
                         "is a power of two")
    if cos.shape != (tokens, head_dim) or sin.shape != cos.shape or cos.stride() != sin.stride() \
            or cos.stride(-1) != 1:
        raise ValueError(f"norm_rope: cos/sin {tuple(cos.shape)} must be [{tokens}, {head_dim}], "
                         "contiguous in the last dim")
    if weight is not None and weight.shape != (head_dim,):
        raise ValueError(f"norm_rope: weight {tuple(weight.shape)} must be [{head_dim}]")
    if tokens:
        _norm_rope_kernel[(tokens, heads)](
            x, weight if weight is not None else cos, cos, sin, eps, x.stride(0), x.stride(1),
            cos.stride(0), HAS_NORM=weight is not None, HALF=head_dim // 2)
    return x


@triton.jit
def _silu_and_mul_kernel(g_ptr, u_ptr, out_ptr, n_cols, stride_g, stride_u, stride_o,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dt = out_ptr.dtype.element_ty
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt)
    tl.store(out_ptr + row * stride_o + cols, (s.to(tl.float32) * u).to(dt), mask=mask)


def silu_and_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [rows, n] tensors."""
    if gate.shape != up.shape or gate.dim() != 2 or gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError(f"silu_and_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} must be "
                         "equal 2-d shapes with a contiguous last dim")
    out = torch.empty_like(gate)
    rows, n = gate.shape
    block = min(1024, triton.next_power_of_2(n))
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
            gate, up, out, n, gate.stride(0), up.stride(0), out.stride(0), BLOCK=block)
    return out


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_k, stride_v,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    i = tl.arange(0, BLOCK)
    mask = i < ROW
    tl.store(kc_ptr + slot * ROW + i, tl.load(k_ptr + tok * stride_k + i, mask=mask), mask=mask)
    tl.store(vc_ptr + slot * ROW + i, tl.load(v_ptr + tok * stride_v + i, mask=mask), mask=mask)


def write_kv_triton(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value: [tokens, kv_heads, head_dim] into caches [blocks, block_size, kv_heads,
    head_dim] (contiguous) at flat slots slot_mapping [tokens]."""
    tokens, kv_heads, head_dim = key.shape
    if value.shape != key.shape or key_cache.shape[2:] != key.shape[1:] \
            or value_cache.shape != key_cache.shape:
        raise ValueError(f"write_kv: key {tuple(key.shape)} / value {tuple(value.shape)} do not fit "
                         f"the caches {tuple(key_cache.shape)}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("write_kv: the caches must be contiguous")
    if slot_mapping.shape != (tokens,):
        raise ValueError(f"write_kv: slot_mapping {tuple(slot_mapping.shape)} must be [{tokens}]")
    row = kv_heads * head_dim
    # The kernel reads a token's row as one run: heads and head_dim must be packed.
    key = key.reshape(tokens, row) if key.stride(1) != head_dim or key.stride(2) != 1 else key
    value = value.reshape(tokens, row) if value.stride(1) != head_dim or value.stride(2) != 1 else value
    slot_mapping = slot_mapping.contiguous()
    if tokens:
        _write_kv_kernel[(tokens,)](key, value, key_cache, value_cache, slot_mapping,
                                    key.stride(0), value.stride(0), ROW=row,
                                    BLOCK=triton.next_power_of_2(row))
