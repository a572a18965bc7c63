"""vLLM's sampling penalties, on logits rows that each know the tokens they were predicted after.

For one row with penalties r (repetition), f (frequency), p (presence), prompt tokens P and
output tokens O so far (c[t]: token t's count in O):

  1. every token t in P or O: logit / r if the logit is positive, else logit * r
     (HF's RepetitionPenaltyLogitsProcessor and vLLM: r > 1 discourages repeats);
  2. every token t in O: logit - f * c[t] - p.

Tokens in neither are left bit-for-bit as they were. The last rank applies these before
temperature, top-k, top-p, min-p and the greedy argmax (stages/last_rank.py).
"""
from __future__ import annotations

import numpy as np
import torch

from ray_runtime.sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, prompt_ids: list[np.ndarray],
                    output_ids: list[np.ndarray], params: list[SamplingParams]) -> torch.Tensor:
    """logits: [rows, vocab]; per row, its prompt and output token ids (int64 arrays, each id
    in [0, vocab)) and its request's params. Returns new logits; the input is not modified
    (logprobs are reported from the raw logits)."""
    num_rows, vocab = logits.shape
    assert len(prompt_ids) == len(output_ids) == len(params) == num_rows
    device = logits.device

    def flat(arrays: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.repeat(np.arange(len(arrays)), [len(a) for a in arrays])
        toks = np.concatenate([np.asarray(a, np.int64) for a in arrays]) if arrays else \
            np.zeros(0, np.int64)
        if len(toks) and not (0 <= toks.min() and toks.max() < vocab):
            raise AssertionError(f"penalties: a token id outside [0, {vocab}) in the history")
        return (torch.from_numpy(rows).to(device), torch.from_numpy(toks).to(device))

    out_rows, out_toks = flat(output_ids)
    counts = torch.zeros(num_rows, vocab, dtype=logits.dtype, device=device)
    counts.index_put_((out_rows, out_toks), torch.ones_like(out_toks, dtype=logits.dtype),
                      accumulate=True)
    in_output = counts > 0
    result = logits
    rep = [sp.repetition_penalty for sp in params]
    if any(r != 1.0 for r in rep):
        seen = in_output.clone()
        seen[flat(prompt_ids)] = True
        r = torch.tensor(rep, dtype=logits.dtype, device=device).unsqueeze(1)
        scale = torch.where(seen, r, torch.ones_like(r))
        result = torch.where(result > 0, result / scale, result * scale)
    freq = [sp.frequency_penalty for sp in params]
    pres = [sp.presence_penalty for sp in params]
    if any(freq) or any(pres):
        f = torch.tensor(freq, dtype=logits.dtype, device=device).unsqueeze(1)
        p = torch.tensor(pres, dtype=logits.dtype, device=device).unsqueeze(1)
        result = result - (f * counts + p * in_output)
    return result if result is not logits else logits.clone()
