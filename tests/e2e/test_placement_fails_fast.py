"""Placement that can never succeed fails at once, before the placement timeout, with the
numbers and the flag to change (ray_runtime/cluster.py, check_cluster_fits); the CLI turns
it into exit status 2. The session cluster: one node, 8 logical CPUs."""
import json
import os
import subprocess
import sys
import time

import pytest
import ray

from ray_runtime import LLM
from ray_runtime.cluster import PlacementInfeasible
from tests.conftest import ROOT


def test_too_few_cpus_in_total_fails_at_once(ray_cluster, tiny_model):
    model = tiny_model("llama")
    t0 = time.monotonic()
    with pytest.raises(PlacementInfeasible, match="num_cpus_per_stage") as e:
        LLM(model, pipeline_parallel_size=2, num_cpus_per_stage=5.0, placement_timeout_s=120)
    assert time.monotonic() - t0 < 30, "must not wait for placement_timeout_s"
    assert "10 CPU in all" in str(e.value) and "8 CPU in total on 1 node" in str(e.value)
    assert "SPREAD" not in str(e.value)


def test_strict_spread_on_one_node_fails_at_once_and_advises_spread(ray_cluster, tiny_model):
    with pytest.raises(PlacementInfeasible, match="--placement-strategy SPREAD"):
        LLM(tiny_model("llama"), pipeline_parallel_size=2, placement_strategy="STRICT_SPREAD")


def test_cli_exits_2_naming_the_flag(ray_cluster, tiny_model, tmp_path):
    """--address joins the session's cluster; the shortfall is a one-line error, exit 2."""
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt_token_ids": [5, 6]}) + "\n")
    address = ray.get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "ray_runtime", "generate", "--model", tiny_model("llama"),
           "-pp", "2", "--num-cpus-per-stage", "6", "--address", address,
           "--input", str(src), "--output", str(tmp_path / "o.jsonl")]
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"joined the Ray cluster at {address} (address=" in proc.stderr
    assert "error: pipeline_parallel_size=2 needs 2 stage bundles of {6 CPU}" in proc.stderr
    assert "--num-cpus-per-stage" in proc.stderr and "Traceback" not in proc.stderr
