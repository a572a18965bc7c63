"""Sampling on the last rank: greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

A seeded request draws the token at output index i from a generator seeded with
(seed, i) alone, so its tokens do not depend on the PP size, the batch it shares, or
whether it was preempted and recomputed in between.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ray_runtime.sampling_params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, index) pairs over the generator's seed space


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per request: [chosen, top-1..top-n] ids and logprobs, and the chosen token's rank;
    # empty lists / 0 where no logprobs were asked.
    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]
    any_logprobs: bool


def seeded_generator(seed: int, output_index: int, device: torch.device) -> torch.Generator:
    mixed = (seed * _SEED_MIX + output_index) % (2 ** 63)
    gen = torch.Generator(device=device)
    gen.manual_seed(mixed)
    return gen


def apply_filters(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """logits: [vocab] float32 -> temperature-scaled logits with filtered entries at -inf."""
    logits = logits / sp.temperature
    k = sp.effective_top_k
    if 0 < k < logits.shape[-1]:
        kth = torch.topk(logits, k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p; the first always stays.
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= sp.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if sp.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < sp.min_p * probs.max(), float("-inf"))
    return logits


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.unseeded = torch.Generator(device=device)
        self.unseeded.seed()

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               output_indices: list[int]) -> torch.Tensor:
        """The sampled ids as a device tensor [num_reqs], without waiting for the device:
        the caller copies them to the host when it needs them (asynchronously)."""
        tokens = torch.argmax(logits, dim=-1)  # greedy rows keep this
        for i, sp in enumerate(params):
            if sp.is_greedy:
                continue
            probs = torch.softmax(apply_filters(logits[i], sp), dim=-1)
            gen = self.unseeded if sp.seed is None else \
                seeded_generator(sp.seed, output_indices[i], logits.device)
            tokens[i] = torch.multinomial(probs, 1, generator=gen)[0]
        return tokens

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 output_indices: list[int], with_logprobs: bool = True) -> SampleResult:
        """logits: [num_reqs, vocab] float32; output_indices: per request, the index of the
        output token being sampled (0 for the first). with_logprobs=False: the caller
        computes the logprob entries itself (the runner does, for every emitted token)."""
        token_list = self.sample(logits, params, output_indices).tolist()
        if not with_logprobs:
            return SampleResult(token_list, [], [], [], any_logprobs=False)
        return self._with_logprobs(logits, params, token_list)

    def _with_logprobs(self, logits: torch.Tensor, params: list[SamplingParams],
                       tokens: list[int]) -> SampleResult:
        wanted = [sp.logprobs for sp in params]
        result = SampleResult(tokens, [[] for _ in params], [[] for _ in params],
                              [0] * len(params), any_logprobs=any(w is not None for w in wanted))
        if not result.any_logprobs:
            return result
        logprobs = torch.log_softmax(logits, dim=-1)
        for i, n in enumerate(wanted):
            if n is None:
                continue
            result.logprob_token_ids[i], result.logprobs[i], result.ranks[i] = \
                token_logprobs(logprobs[i], tokens[i], n)
        return result


def token_logprobs(logprobs: torch.Tensor, token: int, n: int) -> tuple[list[int], list[float], int]:
    """One emitted token's entry, from the raw model logprobs (log_softmax of the logits,
    before temperature and filters, as vLLM reports by default): [chosen, top-1..top-n] ids
    and logprobs, and the chosen token's rank (1 = most likely)."""
    chosen = logprobs[token]
    top = torch.topk(logprobs, n) if n > 0 else None
    ids = [token] + (top.indices.tolist() if top is not None else [])
    vals = [float(chosen)] + (top.values.tolist() if top is not None else [])
    return ids, vals, int((logprobs > chosen).sum()) + 1

