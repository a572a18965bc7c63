"""Speculative-decoding rejection sampling as a Triton kernel: one program per request,
a loop over its drafts for acceptance, then one pass over the vocabulary in BLOCK_V chunks
for the correction / bonus token (exponential race, ties to the lowest index).

Oracle: `kernels.rejection_sampler.rejection_sample_ref`; the output is bit-identical for
identical inputs (all float math is fp32 in the reference's order; the race divides with
IEEE round-to-nearest `div_rn`, as torch does). On CPU it runs under TRITON_INTERPRET=1 (the
tests); on CUDA it is the `rejection_sample` path.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels.rejection_sampler import PLACEHOLDER, validate_inputs


@triton.jit
def _rejection_sample_kernel(
        out_ptr, draft_ptr, num_drafts_ptr, argmax_ptr, target_ptr, draft_probs_ptr,
        uniforms_ptr, noise_ptr, greedy_ptr, K, V,
        HAS_PROBS: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    m = tl.load(num_drafts_ptr + b).to(tl.int32)
    greedy = tl.load(greedy_ptr + b) != 0
    out_row = out_ptr + b * (K + 1)
    # Acceptance: `n` counts the accepted prefix; a position is live while all before it passed.
    n = tl.zeros([], tl.int32)
    for j in range(0, K):
        live = (j < m) & (n == j)
        d = tl.load(draft_ptr + b * K + j, mask=live, other=0)
        ok = d == tl.load(argmax_ptr + b * (K + 1) + j, mask=live, other=-1)
        if HAS_PROBS:
            in_vocab = live & (d >= 0) & (d < V)
            p_d = tl.load(target_ptr + (b * (K + 1) + j) * V + d, mask=in_vocab, other=0.0)
            u = tl.load(uniforms_ptr + b * K + j, mask=live, other=1.0)
            if HAS_DRAFT_PROBS:
                q_d = tl.load(draft_probs_ptr + (b * K + j) * V + d, mask=in_vocab, other=1.0)
                u = u * q_d
            ok = tl.where(greedy, ok, u < p_d)
        ok = ok & live
        tl.store(out_row + j, d, mask=ok)
        n += ok.to(tl.int32)
    tok = tl.load(argmax_ptr + b * (K + 1) + n)
    if HAS_PROBS:
        # Correction (rejected at n < m) from norm(max(p - q, 0)), or bonus (n == m) from p:
        # argmax_v w_v / E_v, keeping the first maximum across and within chunks.
        rejected = n < m
        d_rej = tl.load(draft_ptr + b * K + n, mask=rejected, other=-1)
        p_row = target_ptr + (b * (K + 1) + n) * V
        offs = tl.arange(0, BLOCK_V)
        best_val = tl.full([], float("-inf"), tl.float32)
        best_idx = tl.zeros([], tl.int32)
        num_chunks = tl.where(greedy, 0, tl.cdiv(V, BLOCK_V))
        q_len = tl.where(rejected, V, 0)  # q is read only for a correction
        for c in range(0, num_chunks):
            v = c * BLOCK_V + offs
            in_v = v < V
            w = tl.load(p_row + v, mask=in_v, other=0.0)
            if HAS_DRAFT_PROBS:
                q = tl.load(draft_probs_ptr + (b * K + n) * V + v, mask=v < q_len, other=0.0)
                w = tl.where(rejected, tl.maximum(w - q, 0.0), w)
            else:
                w = tl.where(v == d_rej, 0.0, w)
            e = tl.load(noise_ptr + b * V + v, mask=in_v, other=1.0)
            score = tl.where(in_v, tl.math.div_rn(w, e), float("-inf"))
            c_max = tl.max(score, axis=0)
            c_idx = tl.min(tl.where(score == c_max, v, 2147483647), axis=0)
            take = c_max > best_val
            best_idx = tl.where(take, c_idx, best_idx)
            best_val = tl.where(take, c_max, best_val)
        tok = tl.where(greedy, tok, best_idx.to(tl.int64))
    tl.store(out_row + n, tok)


def rejection_sample_triton(draft_token_ids: torch.Tensor, num_drafts: torch.Tensor,
                            target_argmax: torch.Tensor, target_probs: Optional[torch.Tensor],
                            draft_probs: Optional[torch.Tensor], uniforms: torch.Tensor,
                            exp_noise: Optional[torch.Tensor], is_greedy: torch.Tensor,
                            block_v: int = 1024) -> torch.Tensor:
    """Same arguments and result as `rejection_sample_ref` (see its module for the layout)."""
    validate_inputs(draft_token_ids, num_drafts, target_argmax, target_probs, draft_probs,
                    uniforms, exp_noise, is_greedy)
    named = {"draft_token_ids": draft_token_ids, "num_drafts": num_drafts,
             "target_argmax": target_argmax, "target_probs": target_probs,
             "draft_probs": draft_probs, "uniforms": uniforms, "exp_noise": exp_noise,
             "is_greedy": is_greedy}
    device = draft_token_ids.device
    for name, t in named.items():
        if t is None:
            continue
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, draft_token_ids on {device}")
        if name in ("target_probs", "draft_probs", "uniforms", "exp_noise") \
                and t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
    if block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    B, K = draft_token_ids.shape
    out = torch.full((B, K + 1), PLACEHOLDER, dtype=torch.int64, device=device)
    if B == 0:
        return out
    has_probs, has_draft = target_probs is not None, draft_probs is not None
    V = target_probs.shape[2] if has_probs else 1

    def arg(t):  # contiguous, and a real allocation even when absent or empty
        return out if t is None or t.numel() == 0 else t.contiguous()

    _rejection_sample_kernel[(B,)](
        out, arg(draft_token_ids), arg(num_drafts), arg(target_argmax), arg(target_probs),
        arg(draft_probs), arg(uniforms), arg(exp_noise if has_probs else None),
        is_greedy.contiguous().view(torch.uint8), K, V,
        HAS_PROBS=has_probs, HAS_DRAFT_PROBS=has_draft,
        BLOCK_V=min(block_v, triton.next_power_of_2(V)))
    return out
