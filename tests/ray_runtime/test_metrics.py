"""ray_runtime/metrics.py without Ray: names and kinds, batching (nothing reaches the backend
between flushes), deltas of the engine's totals, per-request latencies, the no-op fallback."""
import logging
import os
import re
import subprocess
import sys

import pytest

from ray_runtime import metrics as M
from ray_runtime.messages import NewRequestData, StageStepResult, StageTiming
from ray_runtime.request import Request
from ray_runtime.sampling_params import SamplingParams

EXPECTED = {
    "num_requests_running": ("gauge", ()), "num_requests_waiting": ("gauge", ()),
    "kv_cache_usage_perc": ("gauge", ()),
    "prompt_tokens": ("counter", ()), "generation_tokens": ("counter", ()),
    "request_success": ("counter", ("finished_reason",)), "num_preemptions": ("counter", ()),
    "spec_decode_num_drafts": ("counter", ()), "spec_decode_num_draft_tokens": ("counter", ()),
    "spec_decode_num_accepted_tokens": ("counter", ()),
    "bookkeeping_mismatches": ("counter", ("pp_rank",)),
    "time_to_first_token_seconds": ("histogram", ()),
    "inter_token_latency_seconds": ("histogram", ()),
    "e2e_request_latency_seconds": ("histogram", ()),
    "request_queue_time_seconds": ("histogram", ()),
    "iteration_tokens_total": ("histogram", ()),
    "stage_step_seconds": ("histogram", ("pp_rank",)),
    "stage_busy_seconds": ("counter", ("pp_rank",)), "stage_idle_seconds": ("counter", ("pp_rank",)),
    "stage_idle_fraction": ("gauge", ("pp_rank",)),
    "stage_recv_wait_seconds": ("counter", ("pp_rank",)),
    "stage_send_seconds": ("counter", ("pp_rank",)),
    "stage_digest_seconds": ("counter", ("pp_rank",)),
    "stage_gpu_busy_seconds": ("counter", ("pp_rank",)),
}


class FakeBackend:
    """ray.util.metrics' three constructors; every call lands in `calls`."""

    def __init__(self, fail_on=None):
        self.calls = []  # (ray name, method, value, tags)
        self.created = {}  # ray name -> (kind, tag_keys, boundaries)
        self.fail_on = fail_on

    def _make(self, kind, name, tag_keys, boundaries=None):
        self.created[name] = (kind, tuple(tag_keys), boundaries)
        backend = self

        class Obj:
            def _rec(self, method, value, tags):
                if backend.fail_on == method:
                    raise RuntimeError("backend down")
                assert set(tags) == set(tag_keys), (name, tags)
                assert all(isinstance(v, str) for v in tags.values())
                backend.calls.append((name, method, value, dict(tags)))

            def inc(self, value, tags=None):
                assert value > 0
                self._rec("inc", value, tags)

            def set(self, value, tags=None):
                self._rec("set", value, tags)

            def observe(self, value, tags=None):
                self._rec("observe", value, tags)

        return Obj()

    def Counter(self, name, description="", tag_keys=None):  # noqa: N802
        return self._make("counter", name, tag_keys)

    def Gauge(self, name, description="", tag_keys=None):  # noqa: N802
        return self._make("gauge", name, tag_keys)

    def Histogram(self, name, description="", boundaries=None, tag_keys=None):  # noqa: N802
        assert boundaries and all(b > 0 for b in boundaries) and boundaries == sorted(boundaries)
        return self._make("histogram", name, tag_keys, boundaries)

    def of(self, short, method=None):
        name = "ray_pp_" + short
        return [(v, t) for n, mth, v, t in self.calls if n == name and method in (None, mth)]


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_names_kinds_and_tags_follow_vllm():
    assert {d.name: (d.kind, d.tags) for d in M.METRICS} == EXPECTED
    prom = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
    for d in M.METRICS:
        assert d.full_name == "ray_pp:" + d.name and prom.match(d.full_name)
        # Ray 2.60 drops names with ':' on export: the registered name has none
        assert d.ray_name == "ray_pp_" + d.name and ":" not in d.ray_name
        assert d.tag_keys[:2] == ("model_name", "engine")
        assert bool(d.buckets) == (d.kind == "histogram")
    backend = FakeBackend()
    M.EngineMetrics("m", "e1", 2, dict, backend=backend)
    assert {n: k for n, (k, _, _) in backend.created.items()} == \
        {"ray_pp_" + n: k for n, (k, _) in EXPECTED.items()}


def _req(rid, prompt_len, max_tokens):
    return Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens,
                   ignore_eos=True), frozenset(), 0)


def _plan(*rids):
    class Plan:
        new_reqs = [NewRequestData(r, 1, [1], 1, 0, [], SamplingParams()) for r in rids]
    return Plan()


def _result(rank, start, recv_done, compute_done, end):
    return StageStepResult(step_id=0, rank=rank, digests=[],
                           timing=StageTiming(start, recv_done, compute_done, end, digest_s=0.0))


def test_hooks_only_buffer_and_flush_records_in_batches():
    clock, backend = Clock(), FakeBackend()
    totals = {"prompt_tokens": 0, "generation_tokens": 0, "num_preemptions": 0,
              "stage_busy_s": [0.0, 0.0], "stage_idle_s": [0.0, 0.0],
              "stage_digest_s": [0.0, 0.0], "stage_gpu_busy_s": [0.0, 0.0],
              "bookkeeping_mismatches": [0, 0], "num_requests_running": 0,
              "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0}
    m = M.EngineMetrics("tiny", "e1", 2, lambda: totals, backend=backend, clock=clock)
    m.flush()  # nothing happened yet: gauges only
    assert {n for n, *_ in backend.calls} <= {"ray_pp_num_requests_running",
                                             "ray_pp_num_requests_waiting",
                                             "ray_pp_kv_cache_usage_perc"}
    backend.calls.clear()

    a, b = _req("a", 4, 3), _req("b", 6, 1)
    requests = {"a": a, "b": b}
    m.on_arrivals(["a", "b"], 10.0)
    m.on_plan(_plan("a", "b"), 10, 10.5)  # 10 tokens scheduled in this step
    m.on_step([_result(0, 10.5, 10.5, 10.6, 10.6), _result(1, 10.5, 10.6, 10.8, 10.8)], requests, 11.0)
    # no token yet: then both get their first at 12.0 (b finishes: max_tokens=1)
    m.on_plan(_plan(), 12, 11.5)
    a.append_output_token(7, 1000)
    b.append_output_token(7, 1000)
    m.on_step([_result(0, 11.5, 11.5, 11.6, 11.6), _result(1, 11.6, 11.7, 11.9, 11.9)], requests, 12.0)
    m.on_finished([b], 12.0)
    a.append_output_token(8, 1000)
    m.on_plan(_plan(), 13, 12.5)
    m.on_step([_result(0, 12.5, 12.5, 12.6, 12.6), _result(1, 12.6, 12.7, 12.9, 12.9)], requests, 13.0)
    a.append_output_token(9, 1000)
    m.on_step([_result(0, 13.5, 13.5, 13.6, 13.6), _result(1, 13.6, 13.7, 13.9, 13.9)], requests, 14.0)
    m.on_finished([a], 14.0)
    totals.update(prompt_tokens=10, generation_tokens=4, num_preemptions=1,
                  stage_busy_s=[0.4, 0.8], stage_idle_s=[0.6, 0.2],
                  bookkeeping_mismatches=[0, 2], num_requests_waiting=3, kv_cache_usage_perc=0.25)
    m.maybe_flush()  # the interval has not passed since the last flush: nothing
    assert backend.calls == []

    clock.t += M.FLUSH_INTERVAL_S
    m.maybe_flush()
    assert [v for v, _ in backend.of("prompt_tokens")] == [10]
    assert [v for v, _ in backend.of("generation_tokens")] == [4]
    assert [v for v, _ in backend.of("num_preemptions")] == [1]
    assert backend.of("spec_decode_num_drafts") == []  # absent total: nothing
    assert [(t["finished_reason"], v) for v, t in backend.of("request_success")] == [("length", 2)]
    assert [(t["pp_rank"], v) for v, t in backend.of("bookkeeping_mismatches")] == [("1", 2)]
    assert [v for v, _ in backend.of("num_requests_waiting")] == [3]
    assert [v for v, _ in backend.of("kv_cache_usage_perc")] == [0.25]
    assert sorted(v for v, _ in backend.of("time_to_first_token_seconds")) == [2.0, 2.0]
    assert sorted(v for v, _ in backend.of("e2e_request_latency_seconds")) == [2.0, 4.0]
    assert sorted(v for v, _ in backend.of("request_queue_time_seconds")) == [0.5, 0.5]
    assert [v for v, _ in backend.of("inter_token_latency_seconds")] == [1.0]  # a: 3 tokens, 12 -> 14
    assert [v for v, _ in backend.of("iteration_tokens_total")] == [10, 2, 1]
    steps = backend.of("stage_step_seconds")
    assert sorted(t["pp_rank"] for _, t in steps) == ["0"] * 4 + ["1"] * 4
    assert sum(v for v, t in steps if t["pp_rank"] == "1") == pytest.approx(0.2 + 0.2 + 0.2 + 0.2)
    recv = {t["pp_rank"]: v for v, t in backend.of("stage_recv_wait_seconds")}
    assert list(recv) == ["1"] and recv["1"] == pytest.approx(0.4)  # rank 0 never waits: no series
    idle = {t["pp_rank"]: v for v, t in backend.of("stage_idle_fraction")}
    assert idle == {"0": pytest.approx(0.6), "1": pytest.approx(0.2)}
    for _, tags in backend.of("generation_tokens"):
        assert tags == {"model_name": "tiny", "engine": "e1"}

    # Totals are not counted twice: a second flush records only their growth.
    backend.calls.clear()
    totals.update(generation_tokens=9, stage_busy_s=[0.5, 0.8], stage_idle_s=[0.6, 0.3])
    m.flush()
    assert [v for v, _ in backend.of("generation_tokens")] == [5]
    assert backend.of("prompt_tokens") == [] and backend.of("time_to_first_token_seconds") == []
    assert {t["pp_rank"]: v for v, t in backend.of("stage_busy_seconds")} == {"0": pytest.approx(0.1)}
    assert {t["pp_rank"]: v for v, t in backend.of("stage_idle_fraction")} == \
        {"0": pytest.approx(0.0), "1": pytest.approx(1.0)}

    snap = m.snapshot()
    assert snap["engine"] == "e1" and snap["model_name"] == "tiny"
    s = snap["metrics"]
    assert s["ray_pp:generation_tokens"] == {"": 9}
    assert s["ray_pp:request_success"] == {"finished_reason=length": 2}
    assert s["ray_pp:time_to_first_token_seconds"][""] == {"count": 2, "sum": pytest.approx(4.0)}
    assert s["ray_pp:stage_step_seconds"]["pp_rank=0"]["count"] == 4
    assert not m._arrival and not m._admitted and not m._first and not m._awaiting


def test_aborted_requests_count_as_abort_without_latencies():
    backend = FakeBackend()
    m = M.EngineMetrics("tiny", "e1", 1, dict, backend=backend)
    r = _req("x", 5, 4)
    m.on_arrivals(["x"], 1.0)
    m.on_plan(_plan("x"), 5, 1.5)
    r.abort()
    m.on_finished([r], 2.0)
    m.flush()
    assert [(t["finished_reason"], v) for v, t in backend.of("request_success")] == [("abort", 1)]
    assert backend.of("e2e_request_latency_seconds") == []
    assert not m._arrival and not m._awaiting


def test_a_failing_backend_warns_once_and_never_raises(caplog):
    backend = FakeBackend(fail_on="inc")
    totals = {"generation_tokens": 1}
    m = M.EngineMetrics("tiny", "e1", 1, lambda: totals, backend=backend)
    with caplog.at_level(logging.WARNING, logger="ray_runtime.metrics"):
        m.flush()
        totals["generation_tokens"] = 3
        m.flush()
        m.flush()
    assert len([r for r in caplog.records if "metrics are off" in r.message]) == 1
    assert backend.calls == []
    assert m.snapshot()["metrics"]["ray_pp:generation_tokens"] == {"": 3}  # still counted


def test_no_ray_util_metrics_means_no_ops(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "ray.util.metrics", None)  # import raises ImportError
    with caplog.at_level(logging.WARNING, logger="ray_runtime.metrics"):
        m = M.EngineMetrics("tiny", "e1", 1, lambda: {"generation_tokens": 2})
    assert any("unavailable" in r.message for r in caplog.records)
    m.flush()
    assert m.snapshot()["metrics"]["ray_pp:generation_tokens"] == {"": 2}


def test_real_backend_without_dashboard_extras():
    """ray.util.metrics needs none of ray[default]'s packages: with them made unimportable,
    the real backend is created and records (no Ray cluster needed)."""
    code = """
import sys
BLOCK = {"aiohttp", "aiohttp_cors", "colorful", "py_spy", "grpc", "opencensus",
         "opentelemetry", "prometheus_client", "smart_open", "virtualenv"}
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCK:
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Blocker())
from ray_runtime.metrics import EngineMetrics, ray_backend
assert ray_backend() is not None
m = EngineMetrics("tiny", "e1", 2, lambda: {"generation_tokens": 5, "stage_busy_s": [0.1, 0.2]})
m.flush()
assert not m._warned
assert m.snapshot()["metrics"]["ray_pp:generation_tokens"] == {"": 5}
print("ok")
"""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
