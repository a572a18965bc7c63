"""Two Ray nodes on one machine (issue 11, item 6): PP=2 with its stages on different nodes
gives the HF reference's tokens, and the stages' node ids differ. The cluster lives in a
process of its own (tests/e2e/two_nodes_run.py): this session's ray.init holds another."""
import json
import os
import subprocess
import sys
import tempfile

from tests.conftest import ROOT, stress_workload
from tests.reference import assert_matches, hf_greedy


def test_pp2_across_two_nodes_equals_reference(tiny_model):
    model = tiny_model("qwen3")
    prompts, _ = stress_workload(seed=31, num_requests=6, max_len=60)
    max_tokens = 6
    args = {"model": model, "prompts": prompts, "max_tokens": max_tokens,
            "strategy": "STRICT_SPREAD", "pythonpath": ROOT}
    with tempfile.TemporaryDirectory(prefix="rn", dir="/tmp") as tmp:
        token = os.path.join(tmp, "auth_token")
        with open(token, "w") as f:
            f.write(os.urandom(32).hex())
        # Ray's files (and the address file `ray.init(address="auto")` reads) stay in tmp.
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "RAY_TMPDIR": tmp,
               "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token}
        env.pop("RAY_ADDRESS", None)
        proc = subprocess.run([sys.executable, "-m", "tests.e2e.two_nodes_run", json.dumps(args)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    report = json.loads(next(x for x in proc.stdout.splitlines()
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
