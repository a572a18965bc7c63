"""Penalties through the whole Ray pipeline, greedy, against references: repetition_penalty
against HF `generate(repetition_penalty=r, do_sample=False)`, every penalty (and mixes)
against a hand-written loop (a full HF forward per step, the formulas, argmax), and the
requests without penalties against plain HF greedy, unchanged by their neighbours. At PP=1
and PP=2, async and sync, and with n-gram speculative decoding (verified positions count the
drafts before them); concurrent requests of different lengths, chunked prefill."""
import functools
import random

import pytest
import torch

from ray_runtime import LLM, SamplingParams
from tests.reference import Reference, _hf_model, assert_matches, hf_greedy

MODEL = "llama"
PENALTIES = [
    {},
    {"repetition_penalty": 1.6},
    {"frequency_penalty": -1.0},  # < 0 favours repeats
    {"repetition_penalty": 0.6},  # < 1 favours repeats
    {"presence_penalty": -2.0},
    {},
    # A token seen once gains 1, twice 0, three times loses 1: the counts matter.
    {"frequency_penalty": 1.0, "presence_penalty": -2.0, "repetition_penalty": 1.2},
    {"presence_penalty": 1.5},
    {"repetition_penalty": 2.0},
    {"frequency_penalty": 2.0},
    {},
]


def workload():
    """Prompts of 3 to 40 tokens, drawn from a few ids so that repeats are common (the
    penalties then matter from the first token), and staggered budgets. The seed is one where
    every penalty changes its request's output and no reference has a near-tie."""
    rng = random.Random(35)
    prompts = [[rng.randrange(3, 3 + 12) for _ in range(rng.randint(3, 40))] for _ in PENALTIES]
    budgets = [rng.randint(10, 16) for _ in PENALTIES]
    return prompts, budgets


def params_of(budget: int, penalties: dict) -> SamplingParams:
    return SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True, **penalties)


@functools.lru_cache(maxsize=None)
def reference_loop(model_dir: str, prompt: tuple, max_new: int, rep: float, freq: float,
                   pres: float) -> Reference:
    """Greedy decoding by hand: the whole sequence through the HF model each step, then
    vLLM's penalties token by token, then argmax."""
    model = _hf_model(model_dir)
    seq, out, gaps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([seq])).logits[0, -1].float().clone()
            for t in set(seq):
                logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
            for t in set(out):
                logits[t] -= freq * out.count(t) + pres
            top = logits.topk(2).values
            gaps.append(float(top[0] - top[1]))
            tok = int(torch.argmax(logits))
            seq.append(tok)
            out.append(tok)
    return Reference(out, gaps)


@functools.lru_cache(maxsize=None)
def hf_repetition(model_dir: str, prompt: tuple, max_new: int, rep: float) -> Reference:
    """HF's own greedy generate with its RepetitionPenaltyLogitsProcessor; the gaps are of
    the processed scores, where the argmax is taken."""
    model = _hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                             repetition_penalty=rep, output_scores=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return Reference(out.sequences[0, len(prompt):].tolist(), gaps)


def check_outputs(model, outs, what: str) -> None:
    prompts, budgets = workload()
    changed = ties = 0
    for i, (out, prompt, m, pen) in enumerate(zip(outs, prompts, budgets, PENALTIES)):
        toks = out.outputs[0].token_ids
        assert len(toks) == m and out.outputs[0].finish_reason == "length"
        plain = hf_greedy(model, tuple(prompt), m)
        if not pen:
            ties += assert_matches(toks, plain, f"request {i}, no penalties ({what})")
            continue
        rep = pen.get("repetition_penalty", 1.0)
        ref = reference_loop(model, tuple(prompt), m, rep, pen.get("frequency_penalty", 0.0),
                             pen.get("presence_penalty", 0.0))
        ties += assert_matches(toks, ref, f"request {i}, {pen} ({what})")
        if set(pen) == {"repetition_penalty"}:
            ties += assert_matches(toks, hf_repetition(model, tuple(prompt), m, rep),
                                   f"request {i}, {pen} vs HF generate ({what})")
        changed += ref.token_ids != plain.token_ids
    assert ties <= 1, f"{ties} tie-excused divergences: suspicious for float32"
    # Otherwise the references above would not tell penalties applied from ignored.
    assert changed == sum(map(bool, PENALTIES)), f"penalties changed only {changed} outputs"


LOGPROBS_OF = 1  # the workload's request that runs again with logprobs


def generate(llm):
    """The workload, plus request LOGPROBS_OF again with logprobs=2."""
    prompts, budgets = workload()
    i = LOGPROBS_OF
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts + [prompts[i]]],
                        [params_of(m, pen) for m, pen in zip(budgets, PENALTIES)]
                        + [SamplingParams(max_tokens=budgets[i], temperature=0.0,
                                          ignore_eos=True, logprobs=2, **PENALTIES[i])])
    llm.check()
    return outs


def check_raw_logprobs(model, outs) -> None:
    """Logprobs are those of the raw logits, before penalties (vLLM's default), and the
    tokens are the penalized ones: the same as the request without logprobs."""
    prompts, _ = workload()
    prompt, with_lp = prompts[LOGPROBS_OF], outs[-1].outputs[0]
    assert with_lp.token_ids == outs[LOGPROBS_OF].outputs[0].token_ids
    with torch.no_grad():
        logits = _hf_model(model)(torch.tensor([prompt + with_lp.token_ids])).logits[0]
    raw = torch.log_softmax(logits[len(prompt) - 1:-1].float(), dim=-1)
    for j, (tok, entry) in enumerate(zip(with_lp.token_ids, with_lp.logprobs)):
        assert abs(entry[tok].logprob - float(raw[j, tok])) < 1e-3, (j, entry, float(raw[j, tok]))


# (PP, async, KV blocks of 16 tokens): at PP=2 async the cap forces preemption, so resumed
# requests are penalized from the history they were re-admitted with.
@pytest.mark.parametrize("pp,async_scheduling,kv_blocks", [(1, True, 64), (1, False, 64),
                                                           (2, True, 12), (2, False, 64)])
def test_penalties_equal_references(ray_cluster, tiny_model, pp, async_scheduling, kv_blocks):
    model = tiny_model(MODEL)
    with LLM(model, pipeline_parallel_size=pp, async_scheduling=async_scheduling,
             max_num_seqs=8, max_num_batched_tokens=24, num_kv_blocks=kv_blocks,
             max_model_len=128, block_size=16, debug_checks=True) as llm:
        outs = generate(llm)
        preemptions = llm.stats()["num_preemptions"]
    check_outputs(model, outs, f"PP={pp} async={async_scheduling}")
    assert (preemptions > 0) == (kv_blocks < 64), preemptions
    check_raw_logprobs(model, outs)


def test_penalties_with_ngram_drafts(ray_cluster, tiny_model):
    """Drafts verified under penalties: position j of a request is penalized as if its first
    j drafts were output, so the accepted tokens are exactly the non-speculative ones."""
    model = tiny_model(MODEL)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    with LLM(model, pipeline_parallel_size=1, max_num_seqs=8, max_num_batched_tokens=24,
             num_kv_blocks=64, max_model_len=128, debug_checks=True,
             speculative_config=spec) as llm:
        outs = generate(llm)
        stats = llm.stats()
    check_outputs(model, outs, "ngram drafts")
    check_raw_logprobs(model, outs)
    assert stats["spec_num_draft_tokens"] > 0
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]

