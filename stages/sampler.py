"""Sampling on the last rank: greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

The draw is the exponential race: argmax(probs / E) with E ~ Exp(1) per token picks token
t with probability probs[t], like torch.multinomial, but with no host-device sync (CUDA's
multinomial makes the host wait for the device, once per call). Every sampled row of a step
is filtered and drawn in one batch. A seeded request's E at output index i is a function of
(seed, i) alone (stages/seeded_noise.py), so its tokens do not depend on the PP size, the
batch it shares, or whether it was preempted and recomputed in between; the other rows' E
come from the sampler's generator.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ray_runtime.sampling_params import SamplingParams
from stages import seeded_noise
from stages.staging import to_device_async



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
    mixed = (seed * seeded_noise.GOLDEN + output_index) % (2 ** 63)  # spreads (seed, index)
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


def apply_filters_batch(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor, min_p: torch.Tensor, *, max_top_k: int = 0,
                        any_top_p: bool = True, any_min_p: bool = True) -> torch.Tensor:
    """apply_filters on every row at once: logits [n, vocab] float32; per row its temperature,
    top_k (0: off), top_p (1: off) and min_p (0: off), on the logits' device. Host values
    (the step skips what no row uses): max_top_k, the largest top_k of the rows (0: none);
    any_top_p, any_min_p: whether any row uses them."""
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    if 0 < max_top_k:
        kmax = min(max_top_k, vocab)
        on = (top_k > 0) & (top_k < vocab)
        k = torch.where(on, top_k, torch.ones_like(top_k)).clamp_(max=kmax)
        kth = torch.topk(logits, kmax, dim=-1).values.gather(1, (k - 1)[:, None])
        kth = torch.where(on[:, None], kth, torch.full_like(kth, float("-inf")))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any_top_p:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop_sorted = ((torch.cumsum(probs, dim=-1) - probs) >= top_p[:, None]) \
            & (top_p < 1.0)[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if any_min_p:
        probs = torch.softmax(logits, dim=-1)
        low = (probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values) \
            & (min_p > 0.0)[:, None]
        logits = logits.masked_fill(low, float("-inf"))
    return logits


# The smallest E the race uses: torch's CUDA exponential_ floors -log(u) at 2^-24 (its u
# near 1 is rounded), and seeded_noise's smallest E is about that. An E of 0 would make any
# token with a probability above ~1e-31 win; one of 2^-24 gives it its true tail chance.
MIN_NOISE = 2.0 ** -24


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of probs / E, with noise E ~ Exp(1) of probs' shape (clamped
    in place to MIN_NOISE): a draw from each row of probs. A filtered token (probability 0)
    is never chosen."""
    return (probs / noise.clamp_min_(MIN_NOISE)).argmax(dim=-1)


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.unseeded = torch.Generator(device=device)
        self.unseeded.seed()

    @staticmethod
    def greedy(logits: torch.Tensor) -> torch.Tensor:
        """Every row's argmax: an all-greedy batch needs nothing else, and takes it on the
        model's dtype exactly (bf16 -> float32 keeps every order, ties included)."""
        return torch.argmax(logits, dim=-1)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               output_indices: list[int]) -> torch.Tensor:
        """The sampled ids as a device tensor [num_reqs], without waiting for the device:
        the caller copies them to the host when it needs them (asynchronously). logits:
        float32 (an all-greedy batch may call greedy() on the model's dtype instead)."""
        tokens = self.greedy(logits)  # greedy rows keep this
        drawn = [i for i, sp in enumerate(params) if not sp.is_greedy]
        if drawn:
            index, values = self._draw(logits, params, output_indices, drawn)
            tokens[index] = values
        return tokens

    def _draw(self, logits: torch.Tensor, params: list[SamplingParams],
              output_indices: list[int], rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampled rows, filtered and drawn as one batch: (their row indices on the
        device, their tokens). A seeded row's noise comes from (seed, output index) alone
        (stages/seeded_noise.py), the others' from the sampler's generator."""
        vocab = logits.shape[-1]
        chosen = [params[i] for i in rows]
        knobs = np.array([[sp.temperature, sp.top_p, sp.min_p] for sp in chosen], np.float32)
        # top_k in int64, 0 where it is off (a k of vocab or more keeps every token)
        k = np.array([sp.effective_top_k for sp in chosen], np.int64)
        k[k >= vocab] = 0
        seeded = [j for j, sp in enumerate(chosen) if sp.seed is not None]
        ints = np.concatenate([np.asarray(rows, np.int64), k, np.asarray(seeded, np.int64)])
        temperature, top_p, min_p = to_device_async(knobs.T.copy(), self.device).unbind(0)
        index, top_k, seeded_pos = to_device_async(ints, self.device).split(
            [len(rows), len(rows), len(seeded)])
        filtered = apply_filters_batch(
            logits.index_select(0, index), temperature, top_k, top_p, min_p,
            max_top_k=int(k.max()), any_top_p=bool((knobs[:, 1] < 1.0).any()),
            any_min_p=bool((knobs[:, 2] > 0.0).any()))
        probs = torch.softmax(filtered, dim=-1)
        keys = [seeded_noise.request_key(chosen[j].seed, output_indices[rows[j]]) for j in seeded]
        if len(seeded) == len(rows):
            noise = seeded_noise.exponentials(keys, vocab, probs.device)
        else:
            noise = torch.empty_like(probs).exponential_(generator=self.unseeded)
            if seeded:
                noise.index_copy_(0, seeded_pos, seeded_noise.exponentials(keys, vocab, probs.device))
        return index, race(probs, noise)

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
        rows = [i for i, n in enumerate(wanted) if n is not None]
        entries = token_logprobs(torch.log_softmax(logits[rows], dim=-1),
                                 [tokens[i] for i in rows], [wanted[i] for i in rows])
        for i, (ids, vals, rank) in zip(rows, entries):
            result.logprob_token_ids[i], result.logprobs[i], result.ranks[i] = ids, vals, rank
        return result


def token_logprobs(logprobs: torch.Tensor, tokens: list[int],
                   nums: list[int]) -> list[tuple[list[int], list[float], int]]:
    """Each emitted token's entry, from the raw model logprobs (log_softmax of the logits,
    before temperature and filters, as vLLM reports by default). logprobs: [E, vocab], one row
    per entry; tokens[e] the token emitted there, nums[e] how many top logprobs it asks for.
    Per entry: [chosen, top-1..top-n] ids and logprobs, and the chosen token's rank (1 = most
    likely). Computed for all entries at once: the host waits for the device once per call,
    not once per row."""
    if not tokens:
        return []
    index = to_device_async(np.asarray(tokens, np.int64), logprobs.device)
    chosen = logprobs.gather(1, index[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    width = max(nums)
    top_ids = top_vals = None
    if width > 0:
        top = torch.topk(logprobs, width, dim=-1)
        top_ids, top_vals = top.indices.tolist(), top.values.tolist()
    chosen_l, ranks_l = chosen[:, 0].tolist(), ranks.tolist()
    return [([t] + (top_ids[e][:n] if n else []), [chosen_l[e]] + (top_vals[e][:n] if n else []),
             ranks_l[e]) for e, (t, n) in enumerate(zip(tokens, nums))]
