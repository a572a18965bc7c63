"""The single-process reference: HF transformers greedy `generate`, CPU, float32, and the
tie rule for comparing against it (docs/invariants.md, "The reference, and its one excuse")."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

TIE_TOLERANCE = 1e-3  # logits; float32 CPU noise between equal computations is ~1e-5


@dataclass
class Reference:
    token_ids: list[int]
    top2_gap: list[float]  # per generated position: reference top-1 minus top-2 logit


@functools.lru_cache(maxsize=8)
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: str, prompt: tuple[int, ...], max_new_tokens: int,
              eos: bool = False) -> Reference:
    return _hf_greedy_cached(model_dir, tuple(prompt), max_new_tokens, eos)


@functools.lru_cache(maxsize=4096)
def _hf_greedy_cached(model_dir: str, prompt: tuple[int, ...], max_new_tokens: int,
                      eos: bool) -> Reference:
    model = _hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             eos_token_id=model.generation_config.eos_token_id if eos else None,
                             pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    gaps = []
    for step_logits in out.logits:
        top = step_logits[0].float().topk(2).values
        gaps.append(float(top[0] - top[1]))
    return Reference(tokens, gaps)


def first_divergence(ours: list[int], ref: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return i
    return None if len(ours) == len(ref) else min(len(ours), len(ref))


def assert_matches(ours: list[int], ref: Reference, what: str) -> bool:
    """Equal token for token, or diverging first where the reference itself had a near-tie
    (then the rest cannot be compared). Returns True when excused by a tie."""
    i = first_divergence(ours, ref.token_ids)
    if i is None:
        return False
    if i < len(ref.top2_gap) and i < len(ours) and ref.top2_gap[i] < TIE_TOLERANCE:
        return True
    raise AssertionError(
        f"{what}: differs from the HF reference at output position {i}: ours "
        f"{ours[max(0, i - 2):i + 3]} vs reference {ref.token_ids[max(0, i - 2):i + 3]} "
        f"(reference top-2 gap {ref.top2_gap[i] if i < len(ref.top2_gap) else 'n/a'}; "
        f"lengths {len(ours)} vs {len(ref.token_ids)})")
