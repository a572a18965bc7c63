"""Speculative decoding through the whole Ray pipeline: greedy outputs equal HF's with and
without drafts at every PP depth, sync and async, under the stress that hides the seeds' bugs;
and the acceptance counts do not depend on the mode (invariant 5 (docs/invariants.md)'s symptom)."""
import pytest

from ray_runtime import LLM, SamplingParams
from tests.conftest import stress_workload
from tests.reference import assert_matches, hf_greedy
from tests.tiny_models import make_draft_model

SPEC_KEYS = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens",
             "spec_num_accepted_tokens_per_pos")


def draft_config(tiny_root, arch="qwen2", k=3, draft=None):
    return {"method": "draft_model", "num_speculative_tokens": k,
            "model": draft or make_draft_model(arch, tiny_root)}


def run(model, pp, prompts, budgets, temperature=0.0, seed=None, **engine):
    params = [SamplingParams(max_tokens=m, temperature=temperature, seed=seed, ignore_eos=True)
              for m in budgets]
    with LLM(model, pipeline_parallel_size=pp, debug_checks=True, **engine) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        stats = llm.stats()
        llm.check()
    for out, m in zip(outs, budgets):
        assert len(out.outputs[0].token_ids) == m
    stats["preempted_requests"] = [i for i, o in enumerate(outs) if o.num_preemptions > 0]
    return [o.outputs[0].token_ids for o in outs], stats


def compare(model, outs, prompts, budgets, what):
    ties = sum(assert_matches(o, hf_greedy(model, tuple(p), m), f"request {i} ({what})")
               for i, (o, p, m) in enumerate(zip(outs, prompts, budgets)))
    assert ties <= 1, f"{ties} tie-excused divergences: suspicious for float32"


@pytest.mark.parametrize("pp,async_scheduling", [(1, False), (1, True), (2, False), (2, True),
                                                 (3, False), (3, True)])
def test_draft_model_greedy_equals_hf_under_stress(ray_cluster, tiny_model, tiny_root, pp,
                                                   async_scheduling):
    """24 requests, prompts up to 250 tokens, a 32-token budget (chunked prefill, drafts
    trimmed to the budget), a KV cap that forces preemption (resumed requests land in
    reused rows), staggered finishes; a draft that the target overrules about a third of
    the time, so rejected drafts roll back counts and blocks all the time."""
    model = tiny_model("qwen2")
    prompts, budgets = stress_workload(seed=41, max_tokens=(2, 24))
    outs, stats = run(model, pp, prompts, budgets, max_num_seqs=16, max_num_batched_tokens=32,
                      num_kv_blocks=24, async_scheduling=async_scheduling,
                      speculative_config=draft_config(tiny_root))
    # Every output is compared, the preempted-and-resumed ones (back in some freed row, with
    # their drafts and counts reset) among them.
    compare(model, outs, prompts, budgets, f"PP={pp} async={async_scheduling}")
    assert stats["num_preemptions"] > 0, "the KV cap was meant to force preemption"
    assert stats["preempted_requests"], "no request was preempted and resumed"
    assert stats["spec_num_drafts"] > 0
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    assert stats["spec_num_rolled_back_blocks"] > 0
    if pp == 1 and async_scheduling:  # steps planned before the drafts they run were known
        assert stats["num_placeholder_tokens"] > 0


@pytest.mark.parametrize("arch,pp,async_scheduling", [("qwen3", 3, True), ("llama", 2, False)])
def test_ngram_greedy_equals_hf_under_stress(ray_cluster, tiny_model, arch, pp, async_scheduling):
    model = tiny_model(arch)
    prompts, budgets = stress_workload(seed=50 + pp, max_tokens=(2, 30))
    # Prompts that repeat a span give the n-gram lookup something to find.
    prompts = [p + p[:12] for p in prompts]
    outs, stats = run(model, pp, prompts, budgets, max_num_seqs=16, max_num_batched_tokens=32,
                      num_kv_blocks=24, async_scheduling=async_scheduling,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                          "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    compare(model, outs, prompts, budgets, f"ngram PP={pp}")
    assert stats["num_preemptions"] > 0, "the KV cap was meant to force preemption"
    assert stats["spec_num_draft_tokens"] > 0


def test_acceptance_counts_identical_sync_async_and_across_pp(ray_cluster, tiny_model, tiny_root):
    """Same greedy workload: same outputs and the same drafted / accepted counts, per
    position, for sync and async at PP=1, 2 and 3 (no budget or KV pressure, which would
    legitimately change when drafts are trimmed or dropped)."""
    model = tiny_model("qwen2")
    prompts, budgets = stress_workload(seed=60, num_requests=16, max_len=60, max_tokens=(6, 30))
    results = {}
    for pp, async_scheduling in [(1, False), (1, True), (2, True), (3, False), (3, True)]:
        outs, stats = run(model, pp, prompts, budgets, max_num_seqs=16,
                          max_num_batched_tokens=2048, async_scheduling=async_scheduling,
                          speculative_config=draft_config(tiny_root, k=4))
        assert stats["num_preemptions"] == 0
        assert (stats["num_placeholder_tokens"] > 0) == (pp == 1 and async_scheduling)
        results[(pp, async_scheduling)] = (outs, {k: stats[k] for k in SPEC_KEYS})
    base_outs, base_counts = results[(1, False)]
    compare(model, base_outs, prompts, budgets, "PP=1 sync")
    assert 0 < base_counts["spec_num_accepted_tokens"] < base_counts["spec_num_draft_tokens"]
    for mode, (outs, counts) in results.items():
        assert outs == base_outs, mode
        assert counts == base_counts, f"{mode}: {counts} != sync PP=1 {base_counts}"


def test_draft_equal_to_target_accepts_every_draft(ray_cluster, tiny_model, tiny_root):
    model = tiny_model("llama")
    prompts, budgets = stress_workload(seed=70, num_requests=12, max_tokens=(5, 20))
    outs, stats = run(model, 2, prompts, budgets, max_num_batched_tokens=64,
                      speculative_config=draft_config(tiny_root, k=3, draft=model))
    compare(model, outs, prompts, budgets, "draft = target")
    assert stats["spec_num_draft_tokens"] > 0
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]
    assert stats["spec_acceptance_rate"] == 1.0
    assert stats["spec_num_rolled_back_blocks"] == 0


def test_seeded_sampling_with_drafts_is_the_same_at_pp1_sync_and_pp2_async(
        ray_cluster, tiny_model, tiny_root):
    """Temperature > 0: every random draw (the draft's, the verifier's) is keyed by
    (seed, output index), so neither the PP size, the mode nor the batch changes a token."""
    model = tiny_model("qwen2")
    prompts, budgets = stress_workload(seed=80, num_requests=10, max_tokens=(5, 20))
    spec = draft_config(tiny_root)
    a, sa = run(model, 1, prompts, budgets, temperature=0.8, seed=7, async_scheduling=False,
                speculative_config=spec)
    b, sb = run(model, 2, prompts, budgets, temperature=0.8, seed=7, speculative_config=spec)
    assert a == b
    assert sa["spec_num_draft_tokens"] > 0 and sa["spec_num_accepted_tokens"] > 0
    assert {k: sa[k] for k in SPEC_KEYS} == {k: sb[k] for k in SPEC_KEYS}


def test_spec_config_and_request_errors(ray_cluster, tiny_model, tiny_root, tmp_path):
    model = tiny_model("qwen2")
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens"):
        LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="speculative_config.method"):
        LLM(model, speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="unknown keys"):
        LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "k": 1})
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLM(model, speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                       "model": str(tmp_path)})
    with pytest.raises(ValueError, match="vocab_size"):
        other = tmp_path / "other"
        other.mkdir()
        import json
        import shutil
        shutil.copy(f"{model}/config.json", other / "config.json")
        cfg = json.loads((other / "config.json").read_text())
        cfg["vocab_size"] += 1
        (other / "config.json").write_text(json.dumps(cfg))
        LLM(model, speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                       "model": str(other)})


@pytest.mark.parametrize("pp", [1, 2])
def test_logprobs_with_drafts_equal_logprobs_without(ray_cluster, tiny_model, tiny_root, pp):
    """Every emitted token, accepted draft or not, gets its entry: the same tokens, logprobs
    and ranks as plain decoding reports (greedy: rank 1)."""
    model = tiny_model("qwen2")
    prompts, budgets = stress_workload(seed=90, num_requests=8, max_len=80, max_tokens=(4, 16))
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=2)
              for m in budgets]
    outs = {}
    for spec in (None, draft_config(tiny_root)):
        with LLM(model, pipeline_parallel_size=pp, speculative_config=spec) as llm:
            outs[spec is None] = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            if spec is not None:
                assert llm.stats()["spec_num_accepted_tokens"] > 0
    for plain, drafted in zip(outs[True], outs[False]):
        a, b = plain.outputs[0], drafted.outputs[0]
        assert a.token_ids == b.token_ids and len(b.logprobs) == len(b.token_ids)
        for tok, la, lb in zip(b.token_ids, a.logprobs, b.logprobs):
            assert set(la) == set(lb) and tok in lb
            for t in la:
                assert lb[t].logprob == pytest.approx(la[t].logprob, abs=1e-4)
            assert lb[tok].rank == 1
