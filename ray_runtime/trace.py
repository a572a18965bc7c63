"""The pipeline trace: Chrome trace / Perfetto JSON, one track per stage and one for the
driver, and the idle fractions computed from the same spans."""
from __future__ import annotations

import json
import os
from typing import Optional

from ray_runtime.messages import StageTiming

DRIVER_TID = 0  # stage r is track r + 1, its device (with the phase clock) GPU_TID + r
GPU_TID = 100


class PipelineTrace:
    def __init__(self, pp_size: int, record_events: bool) -> None:
        self.pp_size = pp_size
        self.record_events = record_events  # spans kept only when a trace file is wanted
        self.events: list[dict] = []
        self._last_end: list[Optional[float]] = [None] * pp_size
        self.busy_s = [0.0] * pp_size
        self.idle_s = [0.0] * pp_size  # between steps, and waiting for activations
        # The host's launch of each step (plan in to kernels queued and activations or
        # samples sent; on ranks > 0 with the wait for the previous rank's header), and how
        # many steps: launch_s / steps against the device's time per step says whether a
        # stage is bound by its host.
        self.launch_s = [0.0] * pp_size
        self.steps = [0] * pp_size
        # the latest phase clock totals per rank (StageTiming.phases), when it runs
        self.phases: list[Optional[dict]] = [None] * pp_size
        self._gpu_ranks: set[int] = set()  # stages whose device spans arrived (a track each)
        self._first_start: list[Optional[float]] = [None] * pp_size

    def _span(self, tid: int, name: str, t0: float, t1: float, args: Optional[dict] = None) -> None:
        if t1 <= t0 or not self.record_events:
            return
        ev = {"name": name, "ph": "X", "pid": 1, "tid": tid, "ts": t0 * 1e6, "dur": (t1 - t0) * 1e6}
        if args:
            ev["args"] = args
        self.events.append(ev)

    def driver_span(self, name: str, t0: float, t1: float, **args) -> None:
        self._span(DRIVER_TID, name, t0, t1, args or None)

    def stage_step(self, rank: int, step_id: int, t: StageTiming) -> None:
        tid, args = rank + 1, {"step": step_id}
        if t.fed_from_step >= 0:  # rank 0: which step's fed-back samples this one waited for
            args["fed_from"] = t.fed_from_step
        prev = self._last_end[rank]
        if prev is not None and t.start > prev:
            self._span(tid, "idle", prev, t.start)
            self.idle_s[rank] += t.start - prev
        if self._first_start[rank] is None:
            self._first_start[rank] = t.start
        if rank > 0:
            self._span(tid, "recv wait", t.start, t.recv_done, args)
            self.idle_s[rank] += t.recv_done - t.start
        else:  # rank 0: applying the plan and staging inputs, before any wait
            self._span(tid, "prepare", t.start, t.recv_done - t.token_wait_s, args)
        if rank == 0 and t.token_wait_s > 0:  # rank 0 waited for fed-back tokens (host path)
            self._span(tid, "token wait", t.recv_done - t.token_wait_s, t.recv_done, args)
            self.idle_s[rank] += t.token_wait_s
        self._span(tid, "compute", t.recv_done, t.compute_done, args)
        self._span(tid, "send", t.compute_done, t.end, args)
        self.busy_s[rank] += t.end - t.recv_done
        self.launch_s[rank] += t.compute_done - t.start - t.token_wait_s
        self.steps[rank] += 1
        if t.phases is not None:
            self.phases[rank] = t.phases
        for sid, g0, g1 in t.gpu_spans or ():
            self._span(GPU_TID + rank, "gpu", g0, g1, {"step": sid})
            self._gpu_ranks.add(rank)
        self._last_end[rank] = max(prev or t.end, t.end)

    def idle_fractions(self) -> list[float]:
        out = []
        for busy, idle in zip(self.busy_s, self.idle_s):
            total = busy + idle
            out.append(idle / total if total > 0 else 0.0)
        return out

    def reset_window(self, t: Optional[float] = None) -> None:
        """Idle time between two generate() calls is the user's, not the pipeline's. t: when
        the engine went busy again; the trace marks it (an instant event "busy" on the
        driver's track: where a call's steps begin, for bench/pipeline_timeline.py)."""
        self._last_end = [None] * self.pp_size
        if t is not None and self.record_events:
            self.events.append({"name": "busy", "ph": "i", "s": "t", "pid": 1,
                                "tid": DRIVER_TID, "ts": t * 1e6})

    def to_json(self) -> dict:
        names = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": DRIVER_TID,
                  "args": {"name": "driver"}}]
        names += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": r + 1,
                   "args": {"name": f"stage {r}"}} for r in range(self.pp_size)]
        names += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": GPU_TID + r,
                   "args": {"name": f"stage {r} gpu"}} for r in sorted(self._gpu_ranks)]
        names.append({"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "pipeline"}})
        return {"traceEvents": names + self.events, "displayTimeUnit": "ms"}

    def write(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_json(), f)
