"""Speculative-decoding verification: which drafts the target accepts, and the one token it
adds after them (the correction at the first rejection, or the bonus when all pass).

Standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023): draft d_j, drawn
from q_j, is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection
the output token is drawn from norm(max(p_j - q_j, 0)); when all m drafts pass, a bonus
token is drawn from p_m. Every emitted token is then distributed exactly as the target's p.
Greedy rows accept while d_j == argmax p_j and emit the argmax where they stop: the output
equals plain greedy decoding token for token.

Randomness is an input (uniforms per draft, one row of Exp(1) noise per request), so the
torch reference and the Triton kernel give identical tokens for identical inputs. The
correction / bonus draw uses the exponential race: argmax_v w_v / E_v with E_v ~ Exp(1) picks
v with probability w_v / sum(w). Only one of the two happens per request, so one noise row
serves both. Ties in argmax go to the lowest index in both implementations.

Layout (B requests, K = the most drafts any of them has, V = vocabulary):
    draft_token_ids [B, K] int64, entries past num_drafts[b] ignored
    num_drafts      [B]    int64, 0 <= num_drafts[b] <= K
    target_argmax   [B, K+1] int64: argmax of the target's logits at each position
    target_probs    [B, K+1, V] float32 (after temperature and filters), or None: all greedy
    draft_probs     [B, K, V] float32, or None: drafts are deterministic (n-gram), q = one-hot
    uniforms        [B, K] float32 in [0, 1)
    exp_noise       [B, V] float32, > 0
    is_greedy       [B] bool
Returns output_token_ids [B, K+1] int64: the emitted tokens, then -1 (PLACEHOLDER).
"""
from __future__ import annotations

from typing import Optional

import torch

PLACEHOLDER = -1


def validate_inputs(draft_token_ids, num_drafts, target_argmax, target_probs, draft_probs,
                    uniforms, exp_noise, is_greedy) -> None:
    """Shape and dtype checks shared by both implementations; raises ValueError."""
    if draft_token_ids.dim() != 2:
        raise ValueError(f"draft_token_ids must be [B, K], got {tuple(draft_token_ids.shape)}")
    B, K = draft_token_ids.shape
    want = {"num_drafts": (num_drafts, (B,)), "target_argmax": (target_argmax, (B, K + 1)),
            "uniforms": (uniforms, (B, K)), "is_greedy": (is_greedy, (B,))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if is_greedy.dtype != torch.bool:
        raise ValueError(f"is_greedy must be bool, got {is_greedy.dtype}")
    if target_probs is None:
        if not bool(is_greedy.all()):
            raise ValueError("target_probs is None but some rows are not greedy")
        return
    if target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (B, K + 1):
        raise ValueError(f"target_probs must be [B, K+1, V] = [{B}, {K + 1}, V], "
                         f"got {tuple(target_probs.shape)}")
    V = target_probs.shape[2]
    if draft_probs is not None and tuple(draft_probs.shape) != (B, K, V):
        raise ValueError(f"draft_probs must be [B, K, V] = {(B, K, V)}, got {tuple(draft_probs.shape)}")
    if tuple(exp_noise.shape) != (B, V):
        raise ValueError(f"exp_noise must be [B, V] = {(B, V)}, got {tuple(exp_noise.shape)}")
    if bool(((num_drafts < 0) | (num_drafts > K)).any()):
        raise ValueError(f"num_drafts must be in [0, {K}], got {num_drafts.tolist()}")


def rejection_sample_ref(draft_token_ids: torch.Tensor, num_drafts: torch.Tensor,
                         target_argmax: torch.Tensor, target_probs: Optional[torch.Tensor],
                         draft_probs: Optional[torch.Tensor], uniforms: torch.Tensor,
                         exp_noise: Optional[torch.Tensor], is_greedy: torch.Tensor) -> torch.Tensor:
    validate_inputs(draft_token_ids, num_drafts, target_argmax, target_probs, draft_probs,
                    uniforms, exp_noise, is_greedy)
    B, K = draft_token_ids.shape
    out = torch.full((B, K + 1), PLACEHOLDER, dtype=torch.int64, device=draft_token_ids.device)
    for b in range(B):
        m = int(num_drafts[b])
        greedy = bool(is_greedy[b])
        j = 0
        while j < m:
            d = int(draft_token_ids[b, j])
            if greedy:
                ok = d == int(target_argmax[b, j])
            else:
                q = 1.0 if draft_probs is None else draft_probs[b, j, d]
                ok = bool(uniforms[b, j] * q < target_probs[b, j, d])
            if not ok:
                break
            out[b, j] = d
            j += 1
        if greedy:
            out[b, j] = target_argmax[b, j]
            continue
        p = target_probs[b, j]
        if j < m:  # rejected: draw from the residual max(p - q, 0)
            if draft_probs is None:
                w = p.clone()
                w[int(draft_token_ids[b, j])] = 0.0
            else:
                w = torch.clamp(p - draft_probs[b, j], min=0.0)
        else:  # all accepted: the bonus token from p itself
            w = p
        out[b, j] = torch.argmax(w / exp_noise[b])
    return out


def rejection_sample(draft_token_ids, num_drafts, target_argmax, target_probs, draft_probs,
                     uniforms, exp_noise, is_greedy) -> torch.Tensor:
    """The Triton kernel on CUDA, the torch reference elsewhere."""
    if draft_token_ids.is_cuda:
        from kernels.rejection_sampler_triton import rejection_sample_triton
        return rejection_sample_triton(draft_token_ids, num_drafts, target_argmax, target_probs,
                                       draft_probs, uniforms, exp_noise, is_greedy)
    return rejection_sample_ref(draft_token_ids, num_drafts, target_argmax, target_probs,
                                draft_probs, uniforms, exp_noise, is_greedy)
