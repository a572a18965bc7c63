"""Async scheduling and the bookkeeping audit: mutation tests prove the audit sees a
corrupted non-last rank within one step, and that repair keeps outputs exact."""
import json

import pytest

from ray_runtime import LLM, SamplingParams
from ray_runtime.gc_pauses import GEN0_THRESHOLD
from tests.conftest import stress_workload
from tests.e2e import faults
from tests.reference import assert_matches, hf_greedy


def _generate(llm, prompts, budgets, ignore_eos=True):
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=ignore_eos) for m in budgets]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def _compare(model, outs, prompts, budgets, eos=False):
    for i, (o, p, m) in enumerate(zip(outs, prompts, budgets)):
        assert_matches(o.outputs[0].token_ids, hf_greedy(model, tuple(p), m, eos=eos), f"request {i}")


@pytest.mark.corrupts_ranks
@pytest.mark.parametrize("hook_cls,rank,pp,full_every", [
    (faults.CorruptToken, 0, 2, 1), (faults.CorruptToken, 1, 3, 1), (faults.CorruptToken, 1, 2, 4),
    (faults.CorruptComputedCounter, 1, 3, 16), (faults.CorruptComputedCounter, 0, 2, 16)])
def test_corruption_is_detected_within_one_step(ray_cluster, tiny_model, tmp_path, hook_cls, rank,
                                                pp, full_every):
    """Counters are audited every step; a corrupted token cell is seen by the full digest
    recompute, so within digest_full_every of its steps (the very step at 1)."""
    model = tiny_model("llama")
    prompts, budgets = stress_workload(seed=31, num_requests=12, max_len=120)
    log = tmp_path / "fault.json"
    with LLM(model, pipeline_parallel_size=pp, max_num_batched_tokens=32,
             on_mismatch="raise", digest_full_every=full_every) as llm:
        llm._set_fault_hook(rank, hook_cls(str(log)))
        with pytest.raises(Exception) as err:
            _generate(llm, prompts, budgets)
        # The failed call leaves the engine serving: without the fault, exact outputs.
        llm._set_fault_hook(rank, None)
        again = _generate(llm, prompts[:4], budgets[:4])
        _compare(model, again, prompts[:4], budgets[:4])
    fired = json.loads(log.read_text())
    msg = str(err.value)
    assert "bookkeeping mismatch" in msg
    assert f"request {fired['req_id']!r} on rank {rank}" in msg
    caught = int(msg.rsplit("(step ", 1)[1].split(")")[0])
    # the request runs at most every pp-th step (micro-batches): full_every of its digests
    lag = 0 if hook_cls is faults.CorruptComputedCounter else pp * (full_every - 1)
    assert fired["step"] <= caught <= fired["step"] + lag, \
        f"fired at step {fired['step']}, caught at {caught}: later than {lag} steps"


@pytest.mark.corrupts_ranks
@pytest.mark.parametrize("hook_cls,async_scheduling", [
    (faults.CorruptToken, True), (faults.CorruptComputedCounter, True),
    (faults.CorruptToken, False)])
def test_repair_keeps_outputs_exact(ray_cluster, tiny_model, tmp_path, hook_cls, async_scheduling):
    model = tiny_model("qwen3")
    prompts, budgets = stress_workload(seed=32, num_requests=16, max_len=150)
    with LLM(model, pipeline_parallel_size=3, max_num_batched_tokens=32,
             async_scheduling=async_scheduling, debug_checks=True) as llm:
        llm._set_fault_hook(1, hook_cls(str(tmp_path / "fault.json")))
        outs = _generate(llm, prompts, budgets)
        stats = llm.stats()
    assert (tmp_path / "fault.json").exists(), "the fault never fired"
    assert stats["bookkeeping_mismatches"] >= 1
    assert stats["num_preemptions"] >= 1  # the repair is a recompute
    _compare(model, outs, prompts, budgets)


@pytest.mark.corrupts_ranks
def test_seed1_bug_planted_on_a_non_last_rank_is_caught(ray_cluster, tiny_model):
    """Long prompts in chunked prefill while short requests finish and rows move: the
    planted vLLM bug (known counter from the computed count) must not go unnoticed."""
    model = tiny_model("mistral")
    prompts, budgets = stress_workload(seed=33, num_requests=16, min_len=150, max_len=250)
    prompts += [[7] * 5] * 8
    budgets += [1, 2, 3, 1, 2, 3, 1, 2]
    with LLM(model, pipeline_parallel_size=3, max_num_batched_tokens=32,
             on_mismatch="raise") as llm:
        llm._set_fault_hook(1, faults.PlantSeed1Bug())
        with pytest.raises(Exception, match=r"bookkeeping mismatch: request .* on rank 1: num_tokens_known"):
            _generate(llm, prompts, budgets)


def test_async_seed1_scenario_without_the_bug(ray_cluster, tiny_model):
    """The same scenario with the real code: exact outputs, no mismatch, check() holds at
    every step (debug_checks) on every rank while rows move under chunked prefill."""
    model = tiny_model("mistral")
    prompts, budgets = stress_workload(seed=33, num_requests=16, min_len=150, max_len=250)
    prompts += [[7] * 5] * 8
    budgets += [1, 2, 3, 1, 2, 3, 1, 2]
    with LLM(model, pipeline_parallel_size=3, max_num_batched_tokens=32, max_num_seqs=8,
             debug_checks=True) as llm:
        outs = _generate(llm, prompts, budgets)
        stats = llm.stats()
        llm.check()
    assert stats["bookkeeping_mismatches"] == 0
    _compare(model, outs, prompts, budgets)


def test_late_results_for_finished_requests_are_dropped(ray_cluster, tiny_model):
    """PP=1 async plans a placeholder step for every decoding request; when a request stops
    on EOS that step's token is late and must be dropped, while the freed row is reused by
    new requests (max_num_seqs=4 with 40 requests)."""
    model = tiny_model("qwen2")
    prompts, _ = stress_workload(seed=5, num_requests=40, max_len=60)
    budgets = [40] * len(prompts)
    with LLM(model, pipeline_parallel_size=1, max_num_batched_tokens=48, max_num_seqs=4,
             debug_checks=True) as llm:
        outs = _generate(llm, prompts, budgets, ignore_eos=False)
        stats = llm.stats()
    assert stats["num_placeholder_tokens"] > 0
    assert any(o.outputs[0].finish_reason == "stop" for o in outs)
    assert stats["num_dropped_samples"] > 0, "placeholder steps of stopped requests come back late"
    assert stats["num_generated_tokens"] == sum(len(o.outputs[0].token_ids) for o in outs)
    _compare(model, outs, prompts, budgets, eos=True)


def test_trace_file_is_valid_chrome_trace(ray_cluster, tiny_model, tmp_path):
    path = tmp_path / "pipeline.json"
    prompts, budgets = stress_workload(seed=7, num_requests=6, max_len=40)
    with LLM(tiny_model("llama"), pipeline_parallel_size=2, trace_file=str(path)) as llm:
        _generate(llm, prompts, budgets)
        stats = llm.stats()
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "driver", 1: "stage 0", 2: "stage 1"}
    spans = [e for e in events if e["ph"] == "X"]
    for e in spans:
        assert {"name", "ts", "dur", "pid", "tid"} <= set(e) and e["dur"] > 0
    by_track = {(e["tid"], e["name"]) for e in spans}
    assert {(1, "compute"), (2, "compute"), (2, "recv wait"), (0, "plan"), (0, "wait")} <= by_track
    assert len(stats["stage_idle_fraction"]) == 2
    assert all(0.0 <= f < 1.0 for f in stats["stage_idle_fraction"])
    # the driver's start-up heap frozen, its collections timed (ray_runtime/gc_pauses.py)
    gc_stats = stats["driver_gc"]
    assert gc_stats["frozen_objects"] > 0 and gc_stats["threshold"][0] == GEN0_THRESHOLD
    assert stats["driver_gc_s"] == gc_stats["total_s"] >= gc_stats["max_s"] >= 0
    assert all(e["tid"] == 0 for e in spans if e["name"] == "gc")
