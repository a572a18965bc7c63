"""The real export path: a private Ray instance with a metrics export port, a PP=2 engine,
and the port scraped during and after the run (tests/e2e/metrics_scrape_run.py, in its own
process). Serving the port needs Ray's dashboard extras (`ray[default]`), which the project
does not install: the test runs with the Python named by RAY_PP_METRICS_PYTHON, or this
one, if it has them, and is skipped otherwise."""
import json
import os
import subprocess
import sys

import pytest

from ray_runtime.metrics import METRICS

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
EXTRAS = "import prometheus_client, opencensus, aiohttp, opentelemetry.exporter.prometheus"


def _python_with_extras():
    for py in (os.environ.get("RAY_PP_METRICS_PYTHON"), sys.executable):
        if py and subprocess.run([py, "-c", EXTRAS], capture_output=True).returncode == 0:
            return py
    return None


def test_scraped_metrics_agree_with_stats(tmp_path):
    py = _python_with_extras()
    if py is None:
        pytest.skip("no Python with ray[default]'s extras (set RAY_PP_METRICS_PYTHON)")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([py, os.path.join(HERE, "metrics_scrape_run.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=150, cwd=ROOT, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    r = json.loads(lines[-1][len("RESULT "):])
    stats, samples = r["stats"], r["samples"]

    def total(name, **labels):
        return sum(v for n, ls, v in samples
                   if n == "ray_ray_pp_" + name and all(ls.get(k) == str(x) for k, x in labels.items()))

    assert any(v > 0 for v in r["during"]), "nothing was exported while the engine ran"
    assert total("generation_tokens_total") == stats["num_generated_tokens"] > 0
    assert total("prompt_tokens_total") == stats["num_prompt_tokens"] == r["num_prompt_tokens"]
    assert total("request_success_total", finished_reason="length") == r["num_requests"]
    assert total("num_preemptions_total") == stats["num_preemptions"]
    assert total("time_to_first_token_seconds_count") == r["num_requests"]
    assert total("iteration_tokens_total_count") == stats["num_steps"]
    assert total("num_requests_running") == 0 and total("num_requests_waiting") == 0
    for rank in (0, 1):  # per-stage series for every rank
        assert total("stage_step_seconds_count", pp_rank=rank) == stats["num_steps"]
        assert total("stage_busy_seconds_total", pp_rank=rank) == \
            pytest.approx(stats["stage_busy_s"][rank], rel=1e-6)
        assert any(n == "ray_ray_pp_stage_idle_fraction" and ls.get("pp_rank") == str(rank)
                   for n, ls, _ in samples)
    assert all(ls["model_name"].endswith("llama") for _, ls, _ in samples)
    exported = {n for n, _, _ in samples}
    # Every metric that had something to record is there, under its Ray name (a counter
    # appears on its first increment: Ray's Counter takes no increment of 0).
    idle = {"bookkeeping_mismatches", "stage_gpu_busy_seconds"}  # none on CPU without faults
    if stats["num_preemptions"] == 0:
        idle.add("num_preemptions")
    for d in METRICS:
        if d.name in idle or d.name.startswith("spec_"):  # no drafts either
            continue
        base = "ray_" + d.ray_name
        assert {base, base + "_total", base + "_count"} & exported, d.name
