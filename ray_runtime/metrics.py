"""Engine metrics through `ray.util.metrics`: the catalog of ray_runtime/metric_defs.py (vLLM
V1's names and kinds under the prefix `ray_pp:`, plus per-stage series; docs/operations.md
lists them all), recorded.

Everything is recorded on the driver: the stages already send a StageTiming with every step
result, so they carry no metrics code. The hot path only keeps plain Python numbers: a few
appends and additions per step, a dict entry per request at arrival, admission, first token
and finish. `flush()` turns them into `ray.util.metrics` calls, at most every
FLUSH_INTERVAL_S of wall time (the driver calls it when the pipeline is full, so it overlaps
the stages' work) and at the end of every generate call. Cumulative counts (tokens,
preemptions, drafts, busy seconds, ...) are not counted twice: `flush()` reads the engine's
own totals (the same numbers `stats()` reports) and records their growth.

Names: the logical name is vLLM's with our prefix (`ray_pp:num_requests_running`). Ray 2.60
drops a metric whose name holds a ':' on export (and warns that it will become an error),
so the Ray metric is registered under the name with ':' replaced by '_', as vLLM's own Ray
metrics do; Ray's exporter then adds its `ray_` namespace, and Prometheus shows
`ray_ray_pp_num_requests_running` (counters with `_total`).

Every counter and gauge exists from engine start (vLLM's convention: dashboards and alerts
need a 0, not a missing series): the constructor records each counter at 0 and each gauge at
0 with every label set it will ever have (`label_sets`: every pp_rank, every finish reason).
Ray's `Counter.inc` refuses 0, but the record call under it (`Metric._record`, the same one
`inc` makes) takes it, and Ray 2.60 then exports the series at 0 (checked on a scrape of the
export port). A histogram cannot be exported without an observation, so each appears with
its first one. Ray 2.60 drops a gauge from the export port two report intervals after its
last `set` (its agent evicts gauges that were not refreshed), so a keep-alive thread sets
every gauge's last value again every half report interval (5 s by default): an idle engine
keeps its gauges.

The backend is `ray.util.metrics` (it needs no dashboard extras); where it cannot be used,
or a record call raises, the engine goes on with no-op metrics after one warning.
`snapshot()` (tests only) returns what was handed to the backend.
"""
from __future__ import annotations

import importlib
import logging
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Optional

logger = logging.getLogger(__name__)

from ray_runtime.metric_defs import METRICS, STAGE_TOTALS, TOTAL_COUNTERS, MetricDef, label_sets

FLUSH_INTERVAL_S = 0.5  # at most this long between flushes while a generate call runs


def gauge_keepalive_s() -> float:
    """Half of Ray's metrics report interval (floored at 1 s, as Ray's exporter does): Ray
    2.60's agent evicts a gauge two intervals after its last set."""
    try:
        import ray

        interval_ms = ray._config.metrics_report_interval_ms()
    except Exception:  # noqa: BLE001 - Ray's default
        interval_ms = 10_000
    return max(interval_ms, 1000) / 2000.0


class NullBackend:
    """No-op instruments: metrics off, or ray.util.metrics unavailable."""

    class _Noop:
        def inc(self, value, tags=None) -> None: ...
        def set(self, value, tags=None) -> None: ...
        def observe(self, value, tags=None) -> None: ...

    def Counter(self, name, description="", tag_keys=None):  # noqa: N802 - ray.util.metrics' names
        return self._Noop()

    Gauge = Counter

    def Histogram(self, name, description="", boundaries=None, tag_keys=None):  # noqa: N802
        return self._Noop()


def _ray_connected() -> bool:
    try:
        import ray

        return ray.is_initialized()
    except Exception:  # noqa: BLE001
        return False


def ray_backend():
    """`ray.util.metrics` (Counter, Gauge, Histogram), or None with one warning if it cannot
    be imported. It needs only Ray's core, not `ray[default]`."""
    try:
        return importlib.import_module("ray.util.metrics")
    except Exception as e:  # noqa: BLE001 - metrics never fail the engine
        logger.warning("ray.util.metrics unavailable (%s): engine metrics are off", e)
        return None


class _Instrument:
    """One metric: its backend object, full tag dicts made once per label set, and what was
    recorded (for snapshot())."""

    __slots__ = ("defn", "obj", "base", "tags", "recorded")

    def __init__(self, defn: MetricDef, obj: Any, base: dict[str, str]) -> None:
        self.defn = defn
        self.obj = obj
        self.base = base
        self.tags: dict[tuple, dict[str, str]] = {}
        self.recorded: dict[str, Any] = {}  # label string -> value, or [count, sum]

    def _tags(self, labels: tuple) -> dict[str, str]:
        t = self.tags.get(labels)
        if t is None:
            t = dict(self.base)
            t.update(zip(self.defn.tags, (str(v) for v in labels)))
            self.tags[labels] = t
        return t

    def _key(self, labels: tuple) -> str:
        return ",".join(f"{k}={v}" for k, v in zip(self.defn.tags, labels))


class EngineMetrics:
    """The driver's metric state: cheap per-step/per-request hooks, and flush()."""

    def __init__(self, model_name: str, engine_id: str, pp_size: int,
                 totals: Callable[[], dict], backend: Any = None,
                 flush_interval_s: float = FLUSH_INTERVAL_S,
                 clock: Callable[[], float] = time.time,
                 keepalive_s: Optional[float] = None) -> None:
        """keepalive_s: how often the gauges' last values are set again (0: never); None:
        `gauge_keepalive_s()` when Ray's own backend is used in a connected Ray process
        (an engine's driver), else never."""
        self.model_name = model_name
        self.engine_id = engine_id
        self.pp_size = pp_size
        self._totals = totals  # the engine's cumulative counts and current gauges
        self._clock = clock
        self.flush_interval_s = flush_interval_s
        self._next_flush = 0.0
        self._warned = False
        self._lock = threading.Lock()  # gauge sets: the loop thread's flush and the keep-alive
        self._keepalive_stop = threading.Event()
        self._keepalive_thread: Optional[threading.Thread] = None
        own_backend = backend is None
        if backend is None:
            backend = ray_backend()
        base = {"model_name": model_name, "engine": engine_id}
        self._inst: dict[str, _Instrument] = {}
        try:
            for d in METRICS if backend is not None else ():
                if d.kind == "histogram":
                    obj = backend.Histogram(d.ray_name, d.description, list(d.buckets), d.tag_keys)
                else:
                    obj = getattr(backend, d.kind.capitalize())(d.ray_name, d.description, d.tag_keys)
                self._inst[d.name] = _Instrument(d, obj, base)
        except Exception as e:  # noqa: BLE001
            self._disable(e)
        if len(self._inst) != len(METRICS):  # no backend: keep the bookkeeping, record to no-ops
            null = NullBackend()
            self._inst = {d.name: _Instrument(d, null.Counter(d.ray_name), base) for d in METRICS}
        # ---- hot-path state: plain numbers, read by flush() ----
        self._last_totals: dict[str, Any] = {}
        self._arrival: dict[str, float] = {}
        self._admitted: dict[str, float] = {}  # first scheduling
        self._first: dict[str, float] = {}  # first output token
        self._awaiting: set[str] = set()  # admitted, no output token yet
        self._iteration_tokens: list[int] = []
        self._last_scheduled_total = 0
        self._step_s: list[list[float]] = [[] for _ in range(pp_size)]
        self._recv_wait_s = [0.0] * pp_size
        self._send_s = [0.0] * pp_size
        self._finished: dict[str, int] = {}  # finish reason -> count since the last flush
        self._ttft: list[float] = []
        self._itl: list[float] = []
        self._e2e: list[float] = []
        self._queue: list[float] = []
        self.zero_init_failed: Optional[Exception] = None
        self._record_initial()
        if keepalive_s is None:
            keepalive_s = gauge_keepalive_s() if own_backend and _ray_connected() else 0.0
        if keepalive_s > 0:
            self._start_keepalive(keepalive_s)

    # ---- engine start: every counter and gauge at 0 ----------------------------------------
    def _record_initial(self) -> None:
        """Every counter at 0 and every gauge at 0, with each label set (`label_sets`), so
        that the first export has them all. Never raises; a backend that refuses a counter's
        0 leaves those series to their first increment (one warning)."""
        for inst in self._inst.values():
            kind = inst.defn.kind
            if kind == "histogram":
                continue  # no series without an observation
            for labels in label_sets(inst.defn, self.pp_size):
                if kind == "gauge":
                    self._set(inst.defn.name, 0.0, labels)
                elif self.zero_init_failed is None:
                    self._zero(inst, labels)

    def _zero(self, inst: _Instrument, labels: tuple) -> None:
        inst.recorded.setdefault(inst._key(labels), 0)
        tags = inst._tags(labels)
        try:
            # Ray's Counter.inc refuses 0; Metric._record (what inc calls once it has
            # checked the value) records it, and the series is exported at 0.
            record = getattr(inst.obj, "_record", None)
            if record is not None:
                record(0.0, tags)
            else:
                inst.obj.inc(0.0, tags)
        except Exception as e:  # noqa: BLE001 - metrics never fail the engine
            self.zero_init_failed = e
            logger.warning("engine metrics: the backend refused a counter's 0 (%r); counters "
                           "appear on their first increment", e)

    # ---- gauge keep-alive ----------------------------------------------------------------
    def _start_keepalive(self, period_s: float) -> None:
        """A daemon thread that sets every gauge's last value again every period_s. It holds
        this object only weakly: it ends with close() or once the engine is gone."""
        ref, stop = weakref.ref(self), self._keepalive_stop

        def run() -> None:
            while not stop.wait(period_s):
                m = ref()
                if m is None:
                    return
                m.refresh_gauges()
                del m

        self._keepalive_thread = threading.Thread(
            target=run, name=f"ray_pp-metrics-keepalive-{self.engine_id}", daemon=True)
        self._keepalive_thread.start()

    def refresh_gauges(self) -> None:
        """Set every gauge's last value again (Ray's agent evicts a gauge left unset for
        two report intervals). Never raises."""
        try:
            with self._lock:
                for inst in self._inst.values():
                    if inst.defn.kind != "gauge":
                        continue
                    for labels, tags in inst.tags.items():
                        value = inst.recorded.get(inst._key(labels))
                        if value is not None:
                            inst.obj.set(value, tags)
        except Exception as e:  # noqa: BLE001
            self._disable(e)

    def close(self) -> None:
        """Stop the keep-alive thread (the engine is shutting down)."""
        self._keepalive_stop.set()
        if self._keepalive_thread is not None:
            self._keepalive_thread.join(timeout=1.0)

    # ---- hooks (hot path) ----------------------------------------------------------------
    def on_arrivals(self, req_ids: Iterable[str], t: float) -> None:
        arrival = self._arrival
        for rid in req_ids:
            arrival[rid] = t

    def on_plan(self, plan, scheduled_tokens_total: int, t: float) -> None:
        """A plan left: its token count (the scheduler's running total moved by it) and the
        requests it admits (a resumed one keeps its first admission time)."""
        self._iteration_tokens.append(scheduled_tokens_total - self._last_scheduled_total)
        self._last_scheduled_total = scheduled_tokens_total
        if plan.new_reqs:
            admitted, first = self._admitted, self._first
            for nr in plan.new_reqs:
                rid = nr.req_id
                if rid not in admitted:
                    admitted[rid] = t
                if rid not in first:
                    self._awaiting.add(rid)

    def on_step(self, results, requests: dict, t: float) -> None:
        """A step's replies (one StageStepResult per rank) were read and its samples
        committed: step times per rank, and the first token of requests that got one."""
        step_s, recv, send = self._step_s, self._recv_wait_s, self._send_s
        for res in results:
            tm = res.timing
            r = res.rank
            step_s[r].append(tm.end - tm.recv_done)
            recv[r] += tm.recv_done - tm.start
            send[r] += tm.end - tm.compute_done
        if self._awaiting:
            done = []
            for rid in self._awaiting:
                req = requests.get(rid)
                if req is None:
                    done.append(rid)
                elif len(req.token_ids) > req.num_prompt_tokens:
                    self._first[rid] = t
                    done.append(rid)
            self._awaiting.difference_update(done)

    def on_finished(self, reqs, t: float) -> None:
        """Requests finished (their last token was committed at t), or aborted."""
        finished = self._finished
        for req in reqs:
            rid = req.req_id
            reason = req.finish_reason or "abort"
            finished[reason] = finished.get(reason, 0) + 1
            arrival = self._arrival.pop(rid, None)
            admitted = self._admitted.pop(rid, None)
            first = self._first.pop(rid, None)
            self._awaiting.discard(rid)
            if arrival is None or reason == "abort":
                continue
            self._e2e.append(t - arrival)
            if admitted is not None:
                self._queue.append(admitted - arrival)
            if first is not None:
                self._ttft.append(first - arrival)
                n = len(req.token_ids) - req.num_prompt_tokens
                if n > 1:
                    self._itl.append((t - first) / (n - 1))

    def maybe_flush(self) -> None:
        if self._clock() >= self._next_flush:
            self.flush()

    # ---- recording -----------------------------------------------------------------------
    def flush(self) -> None:
        """Hand everything since the last flush to the backend. Never raises."""
        now = self._clock()
        self._next_flush = now + self.flush_interval_s
        try:
            self._flush()
        except Exception as e:  # noqa: BLE001 - metrics never fail the engine
            self._disable(e)

    def _flush(self) -> None:
        totals = self._totals()
        last = self._last_totals
        for name in TOTAL_COUNTERS:
            v = totals.get(name)
            if v is not None:
                self._inc(name, v - last.get(name, 0))
                last[name] = v
        for key, name in STAGE_TOTALS.items():
            vals = totals.get(key)
            if vals is None:
                continue
            prev = last.get(key) or [0] * len(vals)
            for r, (v, p) in enumerate(zip(vals, prev)):
                self._inc(name, v - p, (r,))
            last[key] = list(vals)
        busy, idle = totals.get("stage_busy_s"), totals.get("stage_idle_s")
        if busy is not None and idle is not None:
            pb = last.get("_window_busy") or [0.0] * len(busy)
            pi = last.get("_window_idle") or [0.0] * len(idle)
            for r in range(len(busy)):
                d = (busy[r] - pb[r]) + (idle[r] - pi[r])
                if d > 0:
                    self._set("stage_idle_fraction", (idle[r] - pi[r]) / d, (r,))
            last["_window_busy"], last["_window_idle"] = list(busy), list(idle)
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            if totals.get(name) is not None:
                self._set(name, totals[name])
        for r in range(self.pp_size):
            self._inc("stage_recv_wait_seconds", self._recv_wait_s[r], (r,))
            self._inc("stage_send_seconds", self._send_s[r], (r,))
            self._recv_wait_s[r] = self._send_s[r] = 0.0
            steps, self._step_s[r] = self._step_s[r], []
            self._observe("stage_step_seconds", steps, (r,))
        finished, self._finished = self._finished, {}
        for reason, n in finished.items():
            self._inc("request_success", n, (reason,))
        for name, attr in (("time_to_first_token_seconds", "_ttft"),
                           ("inter_token_latency_seconds", "_itl"),
                           ("e2e_request_latency_seconds", "_e2e"),
                           ("request_queue_time_seconds", "_queue"),
                           ("iteration_tokens_total", "_iteration_tokens")):
            values = getattr(self, attr)
            if values:
                setattr(self, attr, [])
                self._observe(name, values)

    def _inc(self, name: str, value: float, labels: tuple = ()) -> None:
        if value <= 0:
            return  # Ray's Counter takes only positive increments
        inst = self._inst[name]
        key = inst._key(labels)
        inst.recorded[key] = inst.recorded.get(key, 0) + value
        try:
            inst.obj.inc(value, inst._tags(labels))
        except Exception as e:  # noqa: BLE001 - metrics never fail the engine
            self._disable(e)

    def _set(self, name: str, value: float, labels: tuple = ()) -> None:
        inst = self._inst[name]
        try:
            with self._lock:  # the keep-alive thread never sets an older value after this one
                inst.recorded[inst._key(labels)] = value
                inst.obj.set(value, inst._tags(labels))
        except Exception as e:  # noqa: BLE001
            self._disable(e)

    def _observe(self, name: str, values: list, labels: tuple = ()) -> None:
        if not values:
            return
        inst = self._inst[name]
        key = inst._key(labels)
        rec = inst.recorded.get(key)
        if rec is None:
            rec = inst.recorded[key] = [0, 0.0]
        rec[0] += len(values)
        rec[1] += sum(values)
        tags = inst._tags(labels)
        observe = inst.obj.observe
        try:
            for v in values:
                observe(v, tags)
        except Exception as e:  # noqa: BLE001
            self._disable(e)

    def _disable(self, error: Exception) -> None:
        """The backend failed: record to no-ops from now on (snapshot() keeps counting)."""
        if not self._warned:
            self._warned = True
            logger.warning("engine metrics: the metrics backend failed (%r); metrics are off "
                           "for this engine from now on", error)
        null = NullBackend._Noop()
        for inst in getattr(self, "_inst", {}).values():
            inst.obj = null

    # ---- tests ---------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Tests only: what has been recorded, after a flush. {"engine", "model_name",
        "metrics": {full name: {label string: value}}}; a label string is "" or e.g.
        "pp_rank=0"; a counter's value is its total, a gauge's its last value, a
        histogram's {"count": n, "sum": s}."""
        self.flush()
        out = {}
        for name, inst in self._inst.items():
            if not inst.recorded:
                continue
            vals = {}
            for key, v in inst.recorded.items():
                vals[key] = {"count": v[0], "sum": v[1]} if isinstance(v, list) else v
            out[inst.defn.full_name] = vals
        return {"engine": self.engine_id, "model_name": self.model_name, "metrics": out}
