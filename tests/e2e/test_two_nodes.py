"""Two Ray nodes on one machine (issue 11, item 6): PP=2 with its stages on different nodes
gives the HF reference's tokens, and the stages' node ids differ. The cluster lives in a
process of its own (tests/e2e/two_nodes_run.py): this session's ray.init holds another."""
import json

from tests.conftest import ROOT, stress_workload
from tests.e2e.private_ray import run_private_ray
from tests.reference import assert_matches, hf_greedy


def test_pp2_across_two_nodes_equals_reference(tiny_model):
    model = tiny_model("qwen3")
    prompts, _ = stress_workload(seed=31, num_requests=6, max_len=60)
    max_tokens = 6
    args = {"model": model, "prompts": prompts, "max_tokens": max_tokens,
            "strategy": "STRICT_SPREAD", "pythonpath": ROOT}
    rc, out, err = run_private_ray("tests.e2e.two_nodes_run", args)
    log = out + err
    assert rc == 0, log[-4000:]
    report = json.loads(next(x for x in out.splitlines()
                             if x.startswith("REPORT "))[len("REPORT "):])
    placement = report["stage_placement"]
    assert [p["rank"] for p in placement] == [0, 1]
    assert len(set(report["nodes"])) == 2
    assert placement[0]["node_id"] != placement[1]["node_id"], placement
    assert {p["node_id"] for p in placement} == set(report["nodes"])
    assert report["bookkeeping_mismatches"] == 0
    for i, (ours, prompt) in enumerate(zip(report["token_ids"], prompts)):
        assert len(ours) == max_tokens
        assert_matches(ours, hf_greedy(model, tuple(prompt), max_tokens), f"request {i}")
    for rank in (0, 1):  # each stage's start line, once (the second node has no log monitor)
        assert log.count(f"stage rank {rank}/2: layers") == 1, log[-4000:]
