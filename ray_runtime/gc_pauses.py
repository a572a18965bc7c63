"""Python's garbage collector in the engine's processes: each collection timed, and the heap
settled once the process is up so that collections stay short.

A collection stops every thread of its process. In the driver that stops planning and
reconciling, and with PP micro-batches in flight every stage starves with it: a full
collection of a driver holding 1,024 requests (torch and Ray imported) took 75-220 ms (a
116 ms pause in the middle of a PP=4 decode stalled all four GPUs, docs/benchmarks.md).
Two things keep them short:
  - the heap built at start-up (imported modules, the model's Python objects, Ray's client)
    is frozen (`gc.freeze`): collections no longer traverse it;
  - the first generation's threshold is raised (GEN0_THRESHOLD allocations instead of 700):
    a step's transient objects (a plan's lists, a reply's structs) are freed before they
    reach it, so a steady step triggers no collection at all.
Cyclic garbage is still collected, later and in bigger but rarer passes.

GcPauses measures what is left: the number and seconds of collections per generation and the
longest, with a hook per pause (the driver draws them as "gc" spans in the pipeline trace).
"""
from __future__ import annotations

import gc
import threading
import time
from typing import Callable, Optional

GEN0_THRESHOLD = 20_000
GEN1_THRESHOLD = 50
GEN2_THRESHOLD = 100


_frozen = 0  # objects frozen by settle_heap in this process (counting them later costs ms)


def settle_heap() -> None:
    """Collect once, freeze what survives (the start-up heap), and raise the thresholds.
    Called by each engine process once it is up; a later call freezes what is alive then
    too (a driver rebuilt in the same process)."""
    global _frozen
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, GEN1_THRESHOLD, GEN2_THRESHOLD)
    _frozen = gc.get_freeze_count()


class GcPauses:
    """Times this process's collections (gc.callbacks) from construction until close().
    on_pause(t0, t1, generation), if given, is called after each collection, in the thread
    that triggered it (wall-clock seconds, time.time())."""

    def __init__(self, on_pause: Optional[Callable[[float, float, int], None]] = None) -> None:
        self.count = [0, 0, 0]  # collections per generation
        self.seconds = [0.0, 0.0, 0.0]
        self.max_s = 0.0
        self._on_pause = on_pause
        # No lock: the callback runs while its thread holds the GIL, and a lock taken in
        # snapshot() would deadlock a collection triggered inside it, in the same thread.
        self._start: dict[int, tuple[float, float]] = {}  # thread id -> (perf, wall) at start
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        tid = threading.get_ident()
        if phase == "start":
            self._start[tid] = (time.perf_counter(), time.time())
            return
        start = self._start.pop(tid, None)
        if start is None:  # installed mid-collection
            return
        dur = time.perf_counter() - start[0]
        gen = info.get("generation", 2)
        self.count[gen] += 1
        self.seconds[gen] += dur
        self.max_s = max(self.max_s, dur)
        if self._on_pause is not None:
            self._on_pause(start[1], start[1] + dur, gen)

    def snapshot(self) -> dict:
        """The totals since this monitor started: what stats() reports as driver_gc (the
        frozen count is settle_heap's: counting the frozen objects again takes ~20 ms)."""
        seconds = list(self.seconds)
        return {"collections": list(self.count), "seconds": [round(x, 6) for x in seconds],
                "total_s": round(sum(seconds), 6), "max_s": round(self.max_s, 6),
                "frozen_objects": _frozen, "threshold": list(gc.get_threshold())}

    def close(self) -> None:
        try:
            gc.callbacks.remove(self._callback)
        except ValueError:
            pass
