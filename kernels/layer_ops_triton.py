"""Fused elementwise kernels of a decoder layer, as Triton kernels: RMSNorm (optionally
adding the residual first), per-head RMSNorm + rotary embedding in place on q or k, SiLU-and-
multiply, and the KV-cache write from a slot mapping.

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
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, eps, stride_tok, stride_head, stride_cs,
                      HAS_NORM: tl.constexpr, HALF: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dt = x_ptr.dtype.element_ty
    i = tl.arange(0, HALF)
    base = x_ptr + tok * stride_tok + head * stride_head
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
    cs = tok * stride_cs
    c1 = tl.load(cos_ptr + cs + i).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + HALF + i).to(tl.float32)
    s1 = tl.load(sin_ptr + cs + i).to(tl.float32)
    s2 = tl.load(sin_ptr + cs + HALF + i).to(tl.float32)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product rounded as the torch ops round it
    o1 = ((f1 * c1).to(dt).to(tl.float32) + (-f2 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((f2 * c2).to(dt).to(tl.float32) + (f1 * s2).to(dt).to(tl.float32)).to(dt)
    tl.store(base + i, o1)
    tl.store(base + HALF + i, o2)


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
