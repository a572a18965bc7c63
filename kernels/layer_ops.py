"""A decoder layer's elementwise ops: torch references (the CPU path, op for op as
transformers computes them, so that float32 matches its `generate`) and dispatch to the fused
Triton kernels of `layer_ops_triton.py` for half-precision models on CUDA. A float32 model
keeps the unfused ops on CUDA too: the compiler contracts a multiply and an add into one FMA
inside a kernel, which transformers' eager ops never do, and float32 is the exactness mode.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import os

import torch.nn.functional as F
from torch import nn

from kernels.paged_attention import write_kv


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim]; cos/sin [tokens, head_dim]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin


def fused_kernels(device: str, dtype: torch.dtype) -> bool:
    """Whether the fused kernels run (half precision on CUDA): fused projections, rope
    tables, the Triton layer ops. Float32, the exactness mode, keeps transformers' ops one
    by one."""
    return device == "cuda" and dtype != torch.float32


def _fused(x: torch.Tensor) -> bool:
    return fused_kernels(x.device.type, x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _fused(x):
        from kernels.layer_ops_triton import rms_norm_triton

        return rms_norm_triton(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), the sum in the model dtype."""
    if _fused(x):
        from kernels.layer_ops_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual=residual)
    s = residual + x
    return rms_norm_ref(s, weight, eps), s


def norm_rope(x: torch.Tensor, weight, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim]: per-head RMSNorm when weight is not None, then rotary."""
    if _fused(x):
        from kernels.layer_ops_triton import norm_rope_triton_

        # in place, on x itself (a strided view of the fused qkv output is fine)
        return norm_rope_triton_(x, weight, eps, cos.contiguous(), sin.contiguous())
    if weight is not None:
        x = rms_norm_ref(x, weight, eps)
    return rope_ref(x, cos, sin)


@dataclass
class RopeCosSin:
    """The rotary embedding's cos and sin for a step: per token ([tokens, head_dim]), or, with
    positions, tables ([positions, head_dim], built once per stage) that a fused kernel
    indexes by each token's position."""
    cos: torch.Tensor
    sin: torch.Tensor
    positions: Optional[torch.Tensor] = None


def attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight, k_weight,
                     eps: float, rope: RopeCosSin, kv: tuple[torch.Tensor, torch.Tensor],
                     slot_mapping: torch.Tensor) -> torch.Tensor:
    """q and k [tokens, heads, head_dim]: per-head RMSNorm when the weights are given, then
    the rotary embedding; k and v into the KV caches at slot_mapping. Returns q. With rope
    tables (half precision on CUDA) it is one kernel launch; otherwise the ops one by one."""
    key_cache, value_cache = kv
    if rope.positions is not None:
        if not _fused(q):
            raise ValueError("attention_inputs: rope tables are for half precision on CUDA only")
        from kernels.layer_ops_triton import qk_rope_kv_triton_

        return qk_rope_kv_triton_(q, k, v, q_weight, k_weight, eps, rope.cos, rope.sin,
                                  rope.positions, key_cache, value_cache, slot_mapping)
    q = norm_rope(q, q_weight, eps, rope.cos, rope.sin)
    k = norm_rope(k, k_weight, eps, rope.cos, rope.sin)
    write_kv(key_cache, value_cache, k, v, slot_mapping)
    return q


# "0": linear layers never take the skinny GEMM (on by default: its timed choice made the
# 1-request decode step 12% faster on an H200 and left 8-256 requests as they were;
# docs/benchmarks.md)
SKINNY_GEMM_ENV = "RAY_RUNTIME_SKINNY_GEMM"


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """layer(x); a few rows of a half-precision model on CUDA through the skinny GEMM kernel
    (kernels/skinny_gemm_triton.py) at the shapes where it was timed faster than the
    library's kernel on this device."""
    if _fused(x) and x.dim() == 2 and os.environ.get(SKINNY_GEMM_ENV, "1") != "0":
        from kernels.skinny_gemm_triton import SKINNY_MAX_ROWS, faster_at, skinny_linear

        if x.shape[0] <= SKINNY_MAX_ROWS and x.stride(1) == 1 and layer.weight.stride(1) == 1 \
                and faster_at(x, layer.weight, layer.bias):
            return skinny_linear(x, layer.weight, layer.bias)
    return layer(x)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if _fused(gate):
        from kernels.layer_ops_triton import silu_and_mul_triton

        return silu_and_mul_triton(gate, up)
    return F.silu(gate) * up
