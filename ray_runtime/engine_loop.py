"""The engine core, run continuously in a thread of the driver actor.

Requests, aborts and calls that must see the core between steps (check, fault hooks) arrive
from the actor's other threads through an inbox; the loop takes them at the top of every
iteration, so the core is only ever touched by the loop thread. What the core reports leaves
through an outbox that one consumer long-polls (`get_outputs`): each poll returns everything
reported since the batch it acknowledges, so a slow consumer gets bigger batches, never a
slower engine, and a poll whose answer was lost (its caller cancelled mid-call) loses
nothing: the next poll, acknowledging the same batch, gets the same outputs again. stats()
and health answer from any thread while a step runs.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable, Optional

from ray_runtime.engine_core import EngineCore
from ray_runtime.messages import RequestDelta, RequestSpec

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 1.0
_MAX_EARLY_ABORTS = 4096
_EARLY_ABORT_S = 5.0


class EngineDeadError(RuntimeError):
    """The engine can run no more requests (its loop stopped, or a rank link is broken)."""


class EngineLoop:
    def __init__(self, core: EngineCore, on_idle: Optional[Callable[[], None]] = None) -> None:
        self.core = core
        self._on_idle = on_idle  # e.g. write the trace file: the engine just ran out of work
        self._cv = threading.Condition()
        self._inbox: list[tuple] = []
        self._out_cv = threading.Condition()
        self._outbox: deque[tuple[int, list[RequestDelta]]] = deque()  # (batch seq, deltas)
        self._seq = 0  # the last batch's number
        self._live: set[str] = set()  # ids added and not yet reported finished
        # Aborts of ids not running, by arrival time: an abort that overtook its add (the
        # actor's threads do not keep call order) is applied when the add comes, if within
        # _EARLY_ABORT_S (a later add of a reused id is a new request). Bounded.
        self._early_aborts: dict[str, float] = {}
        # Ids reported finished lately: an abort of one of them is late, not early. Bounded.
        self._recent_done: dict[str, None] = {}
        self._stopping = False
        self.dead: Optional[str] = None  # why the loop stopped stepping, if it did
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- from any thread -----------------------------------------------------------------
    def add_requests(self, specs: list[RequestSpec]) -> None:
        """Queue requests for the next iteration. A request id that is still running raises
        ValueError here, in the caller, and none of `specs` is added."""
        with self._cv:
            self._raise_if_dead()
            ids = [s.req_id for s in specs]
            clash = self._live.intersection(ids)
            if clash or len(set(ids)) != len(ids):
                dup = sorted(clash)[0] if clash else next(i for i in ids if ids.count(i) > 1)
                raise ValueError(f"request_id {dup!r} is already in use by a running request")
            self._live.update(ids)
            self._inbox.append(("add", specs))
            now = time.monotonic()
            early = [i for i in ids if now - self._early_aborts.pop(i, -1e9) < _EARLY_ABORT_S]
            for i in ids:
                self._recent_done.pop(i, None)
            if early:
                self._inbox.append(("abort", early))
            self._cv.notify()

    def abort(self, req_ids: list[str]) -> None:
        with self._cv:
            now = time.monotonic()
            for i in req_ids:
                if i not in self._live and i not in self._recent_done:
                    self._early_aborts[i] = now
            while len(self._early_aborts) > _MAX_EARLY_ABORTS:
                del self._early_aborts[next(iter(self._early_aborts))]
            self._inbox.append(("abort", list(req_ids)))
            self._cv.notify()

    def call(self, fn: Callable[[EngineCore], object], timeout_s: float = 300.0):
        """fn(core) in the loop thread, between two steps; its result or its exception."""
        fut: Future = Future()
        with self._cv:
            self._raise_if_dead()
            self._inbox.append(("call", fn, fut))
            self._cv.notify()
        return fut.result(timeout=timeout_s)

    def get_outputs(self, ack: int, timeout_s: float) -> tuple[int, list[RequestDelta]]:
        """Every delta reported after batch `ack` (the last one the consumer processed), and
        the number to acknowledge next; waits up to timeout_s for something. Batches up to
        `ack` are dropped. Raises EngineDeadError once the loop has stopped and everything
        has been returned."""
        with self._out_cv:
            box = self._outbox
            while box and box[0][0] <= ack:
                box.popleft()
            if not box and self.dead is None:
                self._out_cv.wait(timeout_s)
            batches = list(box)
        if not batches:
            if self.dead is not None:
                raise EngineDeadError(self.dead)
            return ack, []
        return batches[-1][0], [d for _, out in batches for d in out]

    def health(self) -> dict:
        """Whether the loop is stepping: alive, and either idle or past a step within the
        step deadline."""
        core = self.core
        busy = core.has_work()
        since = time.monotonic() - core.last_progress
        healthy = self.dead is None and self._thread.is_alive() and core.ranks.broken is None \
            and (not busy or core.recovering or since < core.config.step_timeout_s)
        return {"healthy": healthy, "busy": busy, "recovering": core.recovering,
                "seconds_since_last_step": since,
                "num_unfinished": len(self._live), "error": self.dead or core.ranks.broken}

    def stop(self, timeout_s: float = 30.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout_s)

    def _raise_if_dead(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine cannot run any more ({self.dead}); shut it down "
                                  "and create a new one")

    # ---- the loop thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - a bug in the loop: say so to every caller
            logger.exception("the engine loop stopped")
            self._die(f"the engine loop stopped: {type(e).__name__}: {e}")

    def _loop(self) -> None:
        core = self.core
        busy = False
        while True:
            went_idle = False
            with self._cv:
                if busy and not self._inbox and not self._stopping and not core.has_work():
                    busy, went_idle = False, True
            if went_idle:
                self._went_idle()  # a metrics flush, a trace write: not under the lock
            with self._cv:
                while not self._inbox and not self._stopping and not core.has_work():
                    self._cv.wait(_IDLE_WAIT_S)
                if self._stopping:
                    self._die("the engine was shut down")
                    return
                inbox, self._inbox = self._inbox, []
            if not busy:
                busy = True
                core.trace.reset_window(time.time())
                core.last_progress = time.monotonic()  # idle time is not a stalled step
            out: list[RequestDelta] = []
            for item in inbox:
                self._take(item, out)
            if core.has_work():
                try:
                    out.extend(core.step())
                except Exception as e:  # noqa: BLE001 - fails the requests, not the loop
                    logger.error("step failed: %s: %s", type(e).__name__, e)
                    out.extend(core.fail(e))
                if core.ranks.broken is not None:
                    self._emit(out)
                    self._die(f"a rank link is broken: {core.ranks.broken}")
                    return
            if out:
                self._emit(out)

    def _take(self, item: tuple, out: list[RequestDelta]) -> None:
        kind = item[0]
        if kind == "add":
            for spec in item[1]:
                try:
                    self.core.add_request(spec)
                except Exception as e:  # noqa: BLE001 - that request fails, no other
                    out.append(RequestDelta(spec.req_id, [], True, "abort",
                                            error=f"{type(e).__name__}: {e}"))
        elif kind == "abort":
            self.core.abort(item[1])
        else:
            fn, fut = item[1], item[2]
            try:
                fut.set_result(fn(self.core))
            except BaseException as e:  # noqa: BLE001 - the caller gets it
                fut.set_exception(e)

    def _emit(self, out: list[RequestDelta]) -> None:
        with self._cv:
            for d in out:
                if d.finished:
                    self._live.discard(d.req_id)
                    self._recent_done[d.req_id] = None
            while len(self._recent_done) > _MAX_EARLY_ABORTS:
                del self._recent_done[next(iter(self._recent_done))]
        with self._out_cv:
            self._seq += 1
            self._outbox.append((self._seq, out))
            self._out_cv.notify_all()

    def _went_idle(self) -> None:
        core = self.core
        if core.metrics is not None:
            core.metrics.flush()
        if self._on_idle is not None:
            try:
                self._on_idle()
            except Exception:  # noqa: BLE001 - e.g. a trace file that cannot be written
                logger.exception("on_idle failed")

    def _die(self, why: str) -> None:
        """Stop taking work: every queued and unfinished request ends with `why`."""
        with self._cv:
            self.dead = why
            pending = [s.req_id for item in self._inbox if item[0] == "add" for s in item[1]]
            for item in self._inbox:
                if item[0] == "call":
                    item[2].set_exception(EngineDeadError(why))
            self._inbox = []
            live = set(self._live)
            self._live.clear()
        failed = [RequestDelta(r, [], True, "abort", error=why) for r in sorted(live)]
        del pending  # queued adds are in `live` too
        with self._out_cv:
            if failed:
                self._seq += 1
                self._outbox.append((self._seq, failed))
            self._out_cv.notify_all()
