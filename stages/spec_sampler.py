"""The last rank's verification of drafts: the target's logits at each request's 1 + m
positions in, the emitted tokens (accepted drafts, then one correction or bonus token) out.

It lays the batch out for `kernels.rejection_sampler.rejection_sample` and draws its random
inputs. A seeded request draws them from a generator seeded with (seed, index of the first
output token this step emits), so its tokens do not depend on the PP size, the mode or its
row. They do depend on how many drafts each step verifies, which a tight token budget
(drafts trimmed to fit) or a preemption can change; their distribution never changes.
"""
from __future__ import annotations

from typing import Optional

import torch

from kernels.rejection_sampler import rejection_sample
from ray_runtime.sampling_params import SamplingParams
from stages.sampler import apply_filters, seeded_generator

_SPEC_SEED_SALT = 0x5BEC_D0DE  # keeps verification draws apart from the plain sampler's


def target_probs_of(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """[n, V] raw logits -> [n, V] probabilities after temperature and filters."""
    return torch.stack([torch.softmax(apply_filters(row, sp), dim=-1) for row in logits])


class SpecVerifier:
    def __init__(self, device: torch.device, unseeded: torch.Generator) -> None:
        self.device = device
        self._unseeded = unseeded

    def __call__(self, logits: list[torch.Tensor], drafts: list[list[int]],
                 params: list[SamplingParams], output_indices: list[int],
                 draft_probs: Optional[list[Optional[torch.Tensor]]] = None) -> list[list[int]]:
        """logits[b]: [m_b + 1, V] float32 at the request's positions; drafts[b]: its m_b
        drafts; draft_probs[b]: [m_b, V] (the draft model's q) or None (deterministic drafts).
        Returns the emitted tokens per request (1 to m_b + 1 of them)."""
        B = len(drafts)
        K = max(len(d) for d in drafts)
        V = logits[0].shape[-1]
        dev = logits[0].device
        draft_ids = torch.zeros(B, K, dtype=torch.int64)
        num_drafts = torch.tensor([len(d) for d in drafts], dtype=torch.int64)
        for b, d in enumerate(drafts):
            draft_ids[b, :len(d)] = torch.tensor(d, dtype=torch.int64)
        target_argmax = torch.zeros(B, K + 1, dtype=torch.int64, device=dev)
        is_greedy = torch.tensor([sp.is_greedy for sp in params])
        all_greedy = bool(is_greedy.all())
        target_probs = None if all_greedy else torch.zeros(B, K + 1, V, device=dev)
        any_q = draft_probs is not None and any(q is not None for q in draft_probs)
        q_all = torch.zeros(B, K, V, device=dev) if any_q and not all_greedy else None
        uniforms = torch.zeros(B, K, device=dev)
        noise = None if all_greedy else torch.ones(B, V, device=dev)
        for b, (lg, sp) in enumerate(zip(logits, params)):
            m = len(drafts[b])
            target_argmax[b, :m + 1] = torch.argmax(lg, dim=-1)
            if sp.is_greedy:
                continue
            target_probs[b, :m + 1] = target_probs_of(lg, sp)
            if q_all is not None:
                q = draft_probs[b]
                if q is None:  # deterministic draft: q is one-hot
                    q_all[b, torch.arange(m), draft_ids[b, :m]] = 1.0
                else:
                    q_all[b, :m] = q
            gen = self._unseeded if sp.seed is None else \
                seeded_generator(sp.seed ^ _SPEC_SEED_SALT, output_indices[b], dev)
            uniforms[b, :m] = torch.rand(m, generator=gen, device=dev)
            noise[b] = torch.empty(V, device=dev).exponential_(generator=gen)
        out = rejection_sample(draft_ids.to(dev), num_drafts.to(dev), target_argmax, target_probs,
                               q_all, uniforms, noise, is_greedy.to(dev)).tolist()
        return [[t for t in row if t >= 0] for row in out]
