"""The real export path: a private Ray instance with a metrics export port, a PP=2 engine,
and the port scraped during and after the run (tests/e2e/metrics_scrape_run.py, in its own
process). Serving the port needs Ray's dashboard extras, which the `test` extra installs
(`ray[default]` in pyproject.toml): without them this test fails, it does not skip. The run
uses the Python named by RAY_PP_METRICS_PYTHON if set, else this one."""
import json
import os
import subprocess
import sys

import pytest

from ray_runtime.metric_defs import METRICS

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# What Ray's metrics agent imports to serve the export port (ray[default]).
EXTRAS = "import prometheus_client, opencensus, aiohttp, opentelemetry.exporter.prometheus"


@pytest.fixture(scope="module")
def scrape(tmp_path_factory):
    py = os.environ.get("RAY_PP_METRICS_PYTHON") or sys.executable
    check = subprocess.run([py, "-c", EXTRAS], capture_output=True, text=True)
    assert check.returncode == 0, (
        f"{py} lacks Ray's dashboard extras, which serve the metrics export port: "
        f"pip install -e .[test] (it carries ray[default])\n{check.stderr[-1000:]}")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([py, os.path.join(HERE, "metrics_scrape_run.py"),
                           str(tmp_path_factory.mktemp("scrape"))],
                          capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def _total(samples, name, **labels):
    return sum(v for n, ls, v in samples
               if n == "ray_ray_pp_" + name and all(ls.get(k) == str(x) for k, x in labels.items()))


def test_exported_while_running(scrape):
    assert any(v > 0 for v in scrape["during"]), "nothing was exported while the engine ran"


def test_counters_agree_with_stats(scrape):
    stats, samples, n = scrape["stats"], scrape["samples"], scrape["num_requests"]
    assert _total(samples, "generation_tokens_total") == stats["num_generated_tokens"] > 0
    assert _total(samples, "prompt_tokens_total") == stats["num_prompt_tokens"] \
        == scrape["num_prompt_tokens"]
    assert _total(samples, "request_success_total", finished_reason="length") \
        == stats["num_requests_finished"] == n > 0
    # The small KV pool preempts: the counter is compared with a number that is not 0.
    assert _total(samples, "num_preemptions_total") == stats["num_preemptions"] > 0
    assert _total(samples, "time_to_first_token_seconds_count") == n
    assert _total(samples, "e2e_request_latency_seconds_count") == n
    assert _total(samples, "iteration_tokens_total_count") == stats["num_steps"]
    assert _total(samples, "num_requests_running") == 0
    assert _total(samples, "num_requests_waiting") == 0
    assert all(ls["model_name"].endswith("llama") and ls["engine"] == scrape["engine"]
               for _, ls, _ in samples)


def test_per_stage_series_for_every_rank(scrape):
    stats, samples = scrape["stats"], scrape["samples"]
    for rank in (0, 1):
        assert _total(samples, "stage_step_seconds_count", pp_rank=rank) == stats["num_steps"]
        assert _total(samples, "stage_busy_seconds_total", pp_rank=rank) == \
            pytest.approx(stats["stage_busy_s"][rank], rel=1e-6)
        assert _total(samples, "stage_idle_seconds_total", pp_rank=rank) == \
            pytest.approx(stats["stage_idle_s"][rank], rel=1e-6)
        assert any(n == "ray_ray_pp_stage_idle_fraction" and ls.get("pp_rank") == str(rank)
                   for n, ls, _ in samples)


def test_every_metric_is_exported(scrape):
    """Every counter and gauge with every label set (at 0 where nothing happened: bookkeeping
    mismatches, GPU busy time on CPU, speculative decoding), and every histogram, which this
    run observed, under its Ray name."""
    exported = {(n, ls.get("pp_rank"), ls.get("finished_reason")) for n, ls, _ in scrape["samples"]}
    for d in METRICS:
        base = "ray_" + d.ray_name
        name = {"counter": base + "_total", "gauge": base, "histogram": base + "_count"}[d.kind]
        ranks = ("0", "1") if "pp_rank" in d.tags else (None,)
        reasons = ("stop", "length", "abort") if "finished_reason" in d.tags else (None,)
        for r in ranks:
            for reason in reasons:
                assert (name, r, reason) in exported, (d.name, r, reason)
