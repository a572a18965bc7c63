"""Lanes in turn, end to end: at PP>1 with token feedback, a lane's next step must not sit
right behind its own previous step in the pipeline while other lanes run (rank 0 runs plans
in order and would wait a whole round trip for that step's samples). The pipeline trace
records which step's fed-back samples each of rank 0's steps waited for (`fed_from`): with
PP lanes in turn that is the step PP back, never the one just before, through waves of
requests finishing together and new ones admitted behind a queue deeper than max_num_seqs."""
import collections
import json

from ray_runtime import LLM, SamplingParams
from tests.reference import assert_matches, hf_greedy


def test_a_deep_queue_keeps_the_lanes_in_turn(ray_cluster, tiny_model, tmp_path):
    model, path, pp = tiny_model("llama"), tmp_path / "pipeline.json", 3
    prompts = [[3 + (i * 7 + j) % 50 for j in range(4 + i % 3)] for i in range(36)]
    budgets = [10] * len(prompts)  # a lane's requests finish together: waves of admissions
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in budgets]
    with LLM(model, pipeline_parallel_size=pp, max_num_seqs=6, max_num_batched_tokens=256,
             trace_file=str(path)) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for i, (o, p, m) in enumerate(zip(outs, prompts, budgets)):
        assert_matches(o.outputs[0].token_ids, hf_greedy(model, tuple(p), m), f"request {i}")
    lags = collections.Counter(
        e["args"]["step"] - e["args"]["fed_from"] for e in json.loads(path.read_text())["traceEvents"]
        if e.get("tid") == 1 and e.get("name") == "compute" and "fed_from" in e.get("args", {}))
    assert sum(lags.values()) > 50, lags
    # the lag is pp while every lane runs; less only as the last lanes drain
    assert lags[pp] >= 0.8 * sum(lags.values()), f"lanes out of turn: {dict(lags)}"
    assert lags[1] <= 0.05 * sum(lags.values()), f"steps right behind their own: {dict(lags)}"
    # the plans' spans carry their token counts (bench/pipeline_timeline.py's prefill/decode
    # split): every token of every request ran once, recomputed ones aside
    plans = [e["args"] for e in json.loads(path.read_text())["traceEvents"] if e.get("name") == "plan"]
    assert sum(a["tokens"] for a in plans) >= sum(len(p) + m - 1 for p, m in zip(prompts, budgets))
    assert sum(a["prompt_tokens"] for a in plans) >= sum(len(p) for p in prompts)
    assert all(0 <= a["prompt_tokens"] <= a["tokens"] for a in plans)
    assert any(a["tokens"] == a["reqs"] and a["prompt_tokens"] == 0 for a in plans)  # decode
    assert any(2 * a["prompt_tokens"] >= a["tokens"] > a["reqs"] for a in plans)  # prefill
    events = json.loads(path.read_text())["traceEvents"]
    assert any(e.get("name") == "busy" and e.get("ph") == "i" for e in events)  # a call began
