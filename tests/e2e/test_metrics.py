"""Engine metrics on the tests' Ray cluster, read through the test hook
`LLM.metrics_snapshot()` (what the driver handed to ray.util.metrics): they agree with the
outputs and with stats(), per-stage series exist for every rank, and disable_log_stats
records nothing. tests/e2e/test_metrics_prometheus.py scrapes the real export port."""
import pytest

from ray_runtime import LLM, SamplingParams
from ray_runtime.metric_defs import METRICS, label_sets
from tests.conftest import stress_workload


def _one(series: dict, key: str = ""):
    return series[key]


def test_metrics_agree_with_outputs_and_stats_at_pp2(ray_cluster, tiny_model):
    prompts, budgets = stress_workload(seed=11, num_requests=10, min_len=20, max_len=70,
                                       max_tokens=(1, 9))
    reqs = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(max_tokens=b, temperature=0, ignore_eos=True) for b in budgets]
    # A small KV pool: requests get preempted, so the preemption counter is exercised.
    with LLM(tiny_model("llama"), pipeline_parallel_size=2, max_num_batched_tokens=64,
             num_kv_blocks=14, block_size=16, max_model_len=256) as llm:
        start = llm.metrics_snapshot()
        assert start["engine"] == llm.info["engine_id"]
        # Before any request: every counter and gauge at 0, with every label set (issue 19;
        # tests/e2e/test_metrics_two_nodes.py scrapes them), and no histogram yet.
        for d in METRICS:
            if d.kind == "histogram":
                assert d.full_name not in start["metrics"], d.name
            else:
                assert start["metrics"][d.full_name] == dict.fromkeys(
                    [",".join(f"{k}={v}" for k, v in zip(d.tags, labels))
                     for labels in label_sets(d, 2)], 0), d.name
        outs = llm.generate(reqs, params)
        outs += llm.generate(reqs[:4], params[:4])  # a second call adds, never recounts
        snap = llm.metrics_snapshot()
        stats = llm.stats()
    m = snap["metrics"]
    n = len(outs)
    out_lens = [len(o.outputs[0].token_ids) for o in outs]
    assert sum(out_lens) == stats["num_generated_tokens"]
    assert _one(m["ray_pp:generation_tokens"]) == sum(out_lens)
    assert _one(m["ray_pp:prompt_tokens"]) == sum(len(o.prompt_token_ids) for o in outs) \
        == stats["num_prompt_tokens"]
    assert m["ray_pp:request_success"] == {"finished_reason=length": n,
                                           "finished_reason=stop": 0, "finished_reason=abort": 0}
    assert stats["num_preemptions"] > 0
    assert _one(m["ray_pp:num_preemptions"]) == stats["num_preemptions"]
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        h = _one(m["ray_pp:" + name])
        assert h["count"] == n and h["sum"] > 0, name
    itl = _one(m["ray_pp:inter_token_latency_seconds"])
    assert itl["count"] == sum(1 for k in out_lens if k > 1)
    it = _one(m["ray_pp:iteration_tokens_total"])
    assert it["count"] == stats["num_steps"] and it["sum"] == stats["num_scheduled_tokens"]
    assert _one(m["ray_pp:num_requests_running"]) == 0 == _one(m["ray_pp:num_requests_waiting"])
    assert _one(m["ray_pp:kv_cache_usage_perc"]) == 0.0
    # none happened: the series are there at 0 (from engine start)
    assert m["ray_pp:bookkeeping_mismatches"] == {"pp_rank=0": 0, "pp_rank=1": 0}
    assert m["ray_pp:spec_decode_num_drafts"] == {"": 0}
    for rank in (0, 1):
        key = f"pp_rank={rank}"
        steps = m["ray_pp:stage_step_seconds"][key]
        assert steps["count"] == stats["num_steps"] > 0
        busy = m["ray_pp:stage_busy_seconds"][key]
        assert busy == pytest.approx(stats["stage_busy_s"][rank]) == pytest.approx(steps["sum"])
        assert m["ray_pp:stage_idle_seconds"][key] == pytest.approx(stats["stage_idle_s"][rank])
        assert 0.0 <= m["ray_pp:stage_idle_fraction"][key] <= 1.0
        assert m["ray_pp:stage_digest_seconds"][key] == pytest.approx(stats["stage_digest_s"][rank])
    assert "pp_rank=1" in m["ray_pp:stage_recv_wait_seconds"]


def test_spec_decode_counters_agree_with_stats(ray_cluster, tiny_model):
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 8]
    model = tiny_model("llama")  # its own draft: every greedy draft is accepted
    with LLM(model, num_kv_blocks=32, max_model_len=256, speculative_config={
            "method": "draft_model", "model": model, "num_speculative_tokens": 3}) as llm:
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        m = llm.metrics_snapshot()["metrics"]
        stats = llm.stats()
    assert stats["spec_num_drafts"] > 0
    assert _one(m["ray_pp:spec_decode_num_drafts"]) == stats["spec_num_drafts"]
    assert _one(m["ray_pp:spec_decode_num_draft_tokens"]) == stats["spec_num_draft_tokens"]
    assert _one(m["ray_pp:spec_decode_num_accepted_tokens"]) == stats["spec_num_accepted_tokens"] > 0


def test_disable_log_stats_records_nothing(ray_cluster, tiny_model):
    with LLM(tiny_model("llama"), num_kv_blocks=16, max_model_len=128,
             disable_log_stats=True) as llm:
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4))
        assert len(out[0].outputs[0].token_ids) == 4
        assert llm.metrics_snapshot() is None
    with pytest.raises(ValueError, match="disable_log_stats"):
        LLM(tiny_model("llama"), disable_log_stats="yes")


@pytest.mark.corrupts_ranks
def test_bookkeeping_mismatches_by_rank_and_abort(ray_cluster, tiny_model, tmp_path):
    """A corrupted rank shows in bookkeeping_mismatches{pp_rank}; with on_mismatch="raise"
    the failed call's requests count as request_success{finished_reason=abort}."""
    from tests.e2e import faults

    prompts, budgets = stress_workload(seed=31, num_requests=6, max_len=60)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(max_tokens=b, temperature=0, ignore_eos=True) for b in budgets]
    model = tiny_model("llama")
    with LLM(model, pipeline_parallel_size=2, max_num_batched_tokens=32, digest_full_every=1) as llm:
        llm._set_fault_hook(1, faults.CorruptComputedCounter(str(tmp_path / "a.json")))
        llm.generate(reqs, params)  # repaired
        stats = llm.stats()
        m = llm.metrics_snapshot()["metrics"]
    assert stats["bookkeeping_mismatches"] > 0
    assert m["ray_pp:bookkeeping_mismatches"] == {"pp_rank=0": 0,
                                                  "pp_rank=1": stats["bookkeeping_mismatches"]}
    with LLM(model, pipeline_parallel_size=2, max_num_batched_tokens=32, on_mismatch="raise",
             digest_full_every=1) as llm:
        llm._set_fault_hook(1, faults.CorruptComputedCounter(str(tmp_path / "b.json")))
        with pytest.raises(Exception, match="bookkeeping mismatch"):
            llm.generate(reqs, params)
        m = llm.metrics_snapshot()["metrics"]
    success = m["ray_pp:request_success"]
    assert success.get("finished_reason=abort", 0) + success.get("finished_reason=length", 0) \
        == len(reqs) and success["finished_reason=abort"] > 0
    assert m["ray_pp:bookkeeping_mismatches"] == {"pp_rank=0": 0, "pp_rank=1": 1}
