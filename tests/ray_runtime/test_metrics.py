"""ray_runtime/metrics.py without Ray: names and kinds, every counter and gauge series at 0
from engine start, the gauge keep-alive, batching (nothing reaches the backend between
flushes), deltas of the engine's totals, per-request latencies, the no-op fallback."""
import gc
import logging
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from ray_runtime import metrics as M
from ray_runtime.metric_defs import METRICS
from ray_runtime.messages import NewRequestData, RowDigests, StageStepResult, StageTiming
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
    """ray.util.metrics' three constructors; every call lands in `calls`. As Ray's, a
    counter's inc refuses a value <= 0, and `_record` (what inc calls after its check)
    takes any; with_record=False: no `_record` (another backend)."""

    def __init__(self, fail_on=None, with_record=True):
        self.calls = []  # (ray name, method, value, tags)
        self.created = {}  # ray name -> (kind, tag_keys, boundaries)
        self.fail_on = fail_on
        self.with_record = with_record

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
                if value <= 0:
                    raise ValueError(f"value must be >0, got {value}")  # as Ray's Counter
                self._rec("inc", value, tags)

            def __getattr__(self, attr):
                if attr == "_record" and backend.with_record:
                    return lambda value, tags=None: self._rec("record", value, tags)
                raise AttributeError(attr)

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
    assert {d.name: (d.kind, d.tags) for d in METRICS} == EXPECTED
    prom = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
    for d in METRICS:
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
    return StageStepResult(step_id=0, rank=rank, digests=RowDigests(),
                           timing=StageTiming(start, recv_done, compute_done, end, digest_s=0.0))


def test_hooks_only_buffer_and_flush_records_in_batches():
    clock, backend = Clock(), FakeBackend()
    totals = {"prompt_tokens": 0, "generation_tokens": 0, "num_preemptions": 0,
              "stage_busy_s": [0.0, 0.0], "stage_idle_s": [0.0, 0.0],
              "stage_digest_s": [0.0, 0.0], "stage_gpu_busy_s": [0.0, 0.0],
              "bookkeeping_mismatches": [0, 0], "num_requests_running": 0,
              "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0}
    m = M.EngineMetrics("tiny", "e1", 2, lambda: totals, backend=backend, clock=clock)
    backend.calls.clear()  # engine start: every counter and gauge at 0 (tested below)
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
    assert s["ray_pp:request_success"] == {"finished_reason=length": 2,
                                           "finished_reason=stop": 0, "finished_reason=abort": 0}
    assert s["ray_pp:num_preemptions"] == {"": 1}
    assert s["ray_pp:spec_decode_num_drafts"] == {"": 0}  # never incremented: still there
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
    assert [(t["finished_reason"], v) for v, t in backend.of("request_success", "inc")] == \
        [("abort", 1)]
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
    assert [c for c in backend.calls if c[1] == "inc"] == []
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
import threading
from ray_runtime.metrics import EngineMetrics, ray_backend
assert ray_backend() is not None
m = EngineMetrics("tiny", "e1", 2, lambda: {"generation_tokens": 5, "stage_busy_s": [0.1, 0.2]})
m.flush()
assert not m._warned and m.zero_init_failed is None  # Ray's Counter took its 0 (_record)
snap = m.snapshot()["metrics"]
assert snap["ray_pp:generation_tokens"] == {"": 5}
assert snap["ray_pp:num_preemptions"] == {"": 0}
assert snap["ray_pp:stage_gpu_busy_seconds"] == {"pp_rank=0": 0, "pp_rank=1": 0}
assert not [t for t in threading.enumerate() if "keepalive" in t.name]  # no Ray connected
print("ok")
"""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


# ---- every counter and gauge from engine start (issue 19) ------------------------------------
TAG_VALUES = {"pp_rank": lambda pp: [str(r) for r in range(pp)],
              "finished_reason": lambda pp: ["stop", "length", "abort"]}


def _expected_series(pp):
    """(ray name, kind, tags beyond the base ones) of every counter and gauge series that
    must exist at engine start, built from METRICS' tags (not from metrics.label_sets)."""
    out = set()
    for d in METRICS:
        if d.kind == "histogram":
            continue
        assert set(d.tags) <= set(TAG_VALUES), f"{d.name}: a tag with no known values"
        combos = [{}]
        for tag in d.tags:
            combos = [{**c, tag: v} for c in combos for v in TAG_VALUES[tag](pp)]
        out |= {(d.ray_name, d.kind, tuple(sorted(c.items()))) for c in combos}
    return out


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_every_counter_and_gauge_has_every_series_at_start(pp):
    """Constructing EngineMetrics (the engine's start) hands every counter (at 0, through
    `_record`: Ray's inc refuses 0) and every gauge (at 0) to the backend with every label
    set: each pp_rank, each finish reason. The engine's totals are not read (the engine is
    not built yet when its metrics are); histograms have no series without an observation."""
    backend = FakeBackend()
    read = []
    m = M.EngineMetrics("tiny", "e1", pp, lambda: read.append(1) or {}, backend=backend,
                        keepalive_s=0)
    assert read == [] and m.zero_init_failed is None and not m._warned
    got = {}
    for name, method, value, tags in backend.calls:
        assert tags.pop("model_name") == "tiny" and tags.pop("engine") == "e1"
        kind = {"record": "counter", "set": "gauge"}[method]
        key = (name, kind, tuple(sorted(tags.items())))
        assert key not in got, f"{key} recorded twice"
        got[key] = value
    want = _expected_series(pp)
    assert set(got) == want, (sorted(want - set(got)), sorted(set(got) - want))
    assert all(v == 0 for v in got.values())
    # each of the examples, spelled out
    assert ("ray_pp_num_preemptions", "counter", ()) in got
    for reason in ("stop", "length", "abort"):
        assert ("ray_pp_request_success", "counter", (("finished_reason", reason),)) in got
    for r in range(pp):
        assert ("ray_pp_stage_busy_seconds", "counter", (("pp_rank", str(r)),)) in got
        assert ("ray_pp_stage_idle_fraction", "gauge", (("pp_rank", str(r)),)) in got
    # The test hook agrees: every counter and gauge, every label set, at 0.
    snap = m.snapshot()["metrics"]
    for d in METRICS:
        if d.kind == "histogram":
            assert d.full_name not in snap
            continue
        keys = {",".join(f"{k}={v}" for k, v in labels)
                for name, _, labels in want if name == d.ray_name}
        assert snap[d.full_name] == dict.fromkeys(keys, 0), d.name


def test_a_run_without_preemptions_still_exports_them_at_0():
    """The issue's case: tokens were generated, nothing was preempted. The series exists at
    0 from the start, and a flush never hands Ray's Counter an increment of 0."""
    backend = FakeBackend()
    totals = {"generation_tokens": 0, "num_preemptions": 0}
    m = M.EngineMetrics("tiny", "e1", 2, lambda: totals, backend=backend, keepalive_s=0)
    totals["generation_tokens"] = 7
    m.flush()
    assert [v for v, _ in backend.of("num_preemptions")] == [0.0]  # its start, nothing else
    assert [v for v, _ in backend.of("num_preemptions", "record")] == [0.0]
    assert [v for v, _ in backend.of("generation_tokens", "inc")] == [7]
    assert not m._warned
    assert m.snapshot()["metrics"]["ray_pp:num_preemptions"] == {"": 0}


def test_a_backend_refusing_a_counters_zero_warns_once_and_goes_on(caplog):
    """A backend with no `_record` whose inc refuses 0: one warning, the counters appear on
    their first increment, the gauges still exist at start, and metrics stay on."""
    backend = FakeBackend(with_record=False)
    totals = {"num_preemptions": 0}
    with caplog.at_level(logging.WARNING, logger="ray_runtime.metrics"):
        m = M.EngineMetrics("tiny", "e1", 2, lambda: totals, backend=backend, keepalive_s=0)
    assert len([r for r in caplog.records if "first increment" in r.message]) == 1
    assert isinstance(m.zero_init_failed, ValueError) and not m._warned
    assert {n for n, mth, _, _ in backend.calls} == \
        {d.ray_name for d in METRICS if d.kind == "gauge"}
    totals["num_preemptions"] = 2
    m.flush()
    assert [v for v, _ in backend.of("num_preemptions", "inc")] == [2]


def test_keepalive_sets_every_gauge_again_until_closed():
    """Ray 2.60 evicts a gauge two report intervals after its last set: the keep-alive
    thread sets every gauge's last value again, every period, and stops on close()."""
    backend = FakeBackend()
    totals = {"num_requests_waiting": 3, "kv_cache_usage_perc": 0.5}
    m = M.EngineMetrics("tiny", "e1", 2, lambda: totals, backend=backend, keepalive_s=0.05)
    m.flush()
    backend.calls.clear()
    time.sleep(0.4)
    sets = {}
    for name, method, value, tags in list(backend.calls):
        assert method == "set"
        key = (name, tags.get("pp_rank"))
        sets.setdefault(key, []).append(value)
    want = {("ray_pp_num_requests_running", None): 0, ("ray_pp_num_requests_waiting", None): 3,
            ("ray_pp_kv_cache_usage_perc", None): 0.5,
            ("ray_pp_stage_idle_fraction", "0"): 0.0, ("ray_pp_stage_idle_fraction", "1"): 0.0}
    assert set(sets) == set(want)
    for key, values in sets.items():
        assert len(values) >= 2 and set(values) == {want[key]}, (key, values)
    m.close()
    time.sleep(0.15)
    n = len(backend.calls)
    time.sleep(0.2)
    assert len(backend.calls) == n
    assert not m._keepalive_thread.is_alive()


def test_keepalive_thread_ends_with_its_engine():
    """The thread holds the metrics weakly: an engine dropped without close() does not
    leave it running."""
    m = M.EngineMetrics("tiny", "gone1", 1, dict, backend=FakeBackend(), keepalive_s=0.02)
    name = "ray_pp-metrics-keepalive-gone1"
    assert [t for t in threading.enumerate() if t.name == name]
    del m
    gc.collect()
    deadline = time.time() + 2
    while time.time() < deadline and [t for t in threading.enumerate() if t.name == name]:
        time.sleep(0.02)
    assert not [t for t in threading.enumerate() if t.name == name]


def test_keepalive_default_follows_rays_report_interval():
    assert M.gauge_keepalive_s() == max(__import__("ray")._config.metrics_report_interval_ms(),
                                        1000) / 2000
    # an explicit backend (tests) and no Ray connected: no thread unless asked for
    M.EngineMetrics("tiny", "nothread", 1, dict, backend=FakeBackend())
    assert not [t for t in threading.enumerate() if t.name.endswith("-nothread")]
