"""Issue 19: every counter and gauge exists from engine start. Two Ray nodes
(ray.cluster_utils.Cluster, in a process of its own: tests/e2e/metrics_two_nodes_run.py), a
PP=2 engine placed STRICT_SPREAD, every node's metrics export port scraped before any
request: every registered counter (at 0) and gauge is there with its labels, per-stage series
for pp_rank 0 and 1, request_success for each finish reason. After a short run with no
preemptions, num_preemptions is still there at 0; idle past two report intervals, every gauge
still is. Serving the export port needs Ray's dashboard extras (`ray[default]`, in the
`test` extra): without them this test fails, it does not skip."""
import json
import subprocess
import sys

import pytest

from ray_runtime.metric_defs import METRICS
from tests.conftest import ROOT
from tests.e2e.metrics_series import FINISH_REASONS, expected_series
from tests.e2e.private_ray import run_private_ray
from tests.e2e.test_metrics_prometheus import EXTRAS

def _series(by_port: dict) -> dict:
    """(name, labels beyond model_name/engine) -> [(port, value)] over every node's port."""
    out = {}
    for port, samples in by_port.items():
        assert isinstance(samples, list), f"port {port}: {samples}"
        for name, labels, v in samples:
            k = (name, tuple(sorted((a, b) for a, b in labels.items()
                                    if a not in ("model_name", "engine", "le"))))
            out.setdefault(k, []).append((port, v))
    return out


@pytest.fixture(scope="module")
def report(tiny_model):
    check = subprocess.run([sys.executable, "-c", EXTRAS], capture_output=True, text=True)
    assert check.returncode == 0, (
        "Ray's dashboard extras, which serve the metrics export port, are missing: "
        f"pip install -e .[test] (it carries ray[default])\n{check.stderr[-1000:]}")
    args = {"model": tiny_model("llama"), "pythonpath": ROOT}
    rc, out, err = run_private_ray("tests.e2e.metrics_two_nodes_run", args)
    lines = [x for x in out.splitlines() if x.startswith("REPORT ")]
    assert rc == 0 and lines, (out + err)[-4000:]
    return json.loads(lines[-1][len("REPORT "):])


def test_two_nodes_each_with_an_export_port_and_stages_spread(report):
    assert sorted(n["metrics_export_port"] for n in report["nodes"]) == sorted(report["ports"])
    placement = report["stats_before"]["stage_placement"]
    assert [p["rank"] for p in placement] == [0, 1]
    assert placement[0]["node_id"] != placement[1]["node_id"]  # STRICT_SPREAD


def test_every_counter_and_gauge_exported_before_any_request(report):
    stats = report["stats_before"]
    assert stats["num_steps"] == 0 and stats["num_requests_finished"] == 0  # nothing ran
    got = _series(report["before"])
    want = expected_series(2)
    missing = sorted(k for k in want if k not in got)
    assert not missing, f"not exported at engine start: {missing}"
    for k, kind in want.items():
        # one node exports each (the driver's: it records them all), at 0
        assert len(got[k]) == 1, (k, got[k])
        assert got[k][0][1] == 0.0, (k, got[k])
    # the examples, spelled out
    assert ("ray_ray_pp_num_preemptions_total", ()) in got
    for reason in FINISH_REASONS:
        assert ("ray_ray_pp_request_success_total", (("finished_reason", reason),)) in got
    for d in METRICS:
        if "pp_rank" in d.tags and d.kind != "histogram":
            suffix = "_total" if d.kind == "counter" else ""
            for rank in ("0", "1"):
                assert ("ray_" + d.ray_name + suffix, (("pp_rank", rank),)) in got, d.name
    # Histograms have no series without an observation (docs/operations.md).
    assert not [k for k in got if k[0].endswith("_count")]


def test_a_run_without_preemptions_exports_them_at_0(report):
    stats, after = report["stats"], _series(report["after"])
    assert stats["num_preemptions"] == 0 and stats["num_generated_tokens"] == 8
    assert after[("ray_ray_pp_num_preemptions_total", ())][0][1] == 0.0
    assert after[("ray_ray_pp_generation_tokens_total", ())][0][1] == 8.0
    reasons = {r: after[("ray_ray_pp_request_success_total", (("finished_reason", r),))][0][1]
               for r in FINISH_REASONS}
    assert reasons == {"stop": 0.0, "length": 2.0, "abort": 0.0}
    assert after[("ray_ray_pp_spec_decode_num_drafts_total", ())][0][1] == 0.0
    assert not [k for k in expected_series(2) if k not in after]


def test_gauges_stay_while_the_engine_is_idle(report):
    """Ray 2.60 evicts a gauge two report intervals (here 2 s) after its last set; the
    engine's keep-alive sets them again: every scrape 1.5 to 4.5 s after the run has them."""
    gauges = [k for k, kind in expected_series(2).items() if kind == "gauge"]
    for i, scrape in enumerate(report["idle"]):
        got = _series(scrape)
        assert not [k for k in gauges if k not in got], (i, sorted(k for k in gauges
                                                                   if k not in got))
        assert got[("ray_ray_pp_num_requests_running", ())][0][1] == 0.0
