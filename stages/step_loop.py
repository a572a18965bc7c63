"""A stage's long-running step loop: plans in, results out, over the driver's channel.

The loop runs in its own thread of the stage actor, so no Ray call sits on the step path.
It launches a plan as soon as it arrives, before finishing the steps still running, so the
host's work on plan N+1 (applying it, staging inputs, queueing kernels) overlaps the
device's work on step N; with token feedback (PP>1) rank 0 holds a micro-batch's steps for
a whole trip through the pipeline, and later micro-batches launch meanwhile. Every plan gets
exactly one reply, in plan order: its result, or the error that stopped it.
"""
from __future__ import annotations

import threading
import traceback
from collections import deque
from typing import Optional

from ray_runtime.channel import ERROR, PLAN, RESULT, STOP, Channel, ChannelClosed, Listener
from ray_runtime.messages import decode_plan, encode
from stages.profiling import StepProfiler, phase, start_step_loop, stop_step_loop

_POLL_S = 0.0002  # how often a waiting loop checks the device while no plan arrives


class StepLoop:
    def __init__(self, runner, host: str) -> None:
        self.runner = runner
        self.listener = Listener(host)
        self.error: Optional[str] = None  # why the loop stopped, if not asked to
        self._thread = threading.Thread(target=self._run, name=f"stage{runner.rank}-loop",
                                        daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.address

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            chan = self.listener.accept(peer="driver")
        except OSError as e:
            self.error = f"no driver connected: {e}"
            return
        try:
            self._serve(chan)
        except ChannelClosed as e:  # the driver went away: nothing left to answer
            self.error = str(e)
        finally:
            chan.close()

    def _serve(self, chan: Channel) -> None:
        # Launched steps not answered yet, in plan order; a launch that failed is its error
        # text, answered in its turn. A plan is launched as soon as it arrives (the device
        # gets the next step queued before the previous one is done); the oldest step is
        # answered as soon as it is done. With as many steps out as the driver keeps in
        # flight no plan can come before a reply: then the loop waits for the oldest step.
        pending: deque = deque()
        limit = self.runner.config.inflight_steps
        start_step_loop(self.runner.device)
        prof = StepProfiler.from_env(self.runner)
        try:
            while True:
                while pending and (isinstance(pending[0], str) or self.runner.step_done(pending[0])):
                    self._reply(chan, pending.popleft(), prof)
                if pending and len(pending) >= limit:
                    self._reply(chan, pending.popleft(), prof)  # waits for the device
                    continue
                with phase("wait for plan"):
                    if pending and not chan.readable(_POLL_S):
                        continue
                    kind, payload = chan.recv()
                if kind == STOP:
                    while pending:
                        self._reply(chan, pending.popleft(), prof)
                    return
                assert kind == PLAN, f"unexpected frame kind {kind}"
                if prof is not None:
                    prof.on_plan()
                try:
                    with phase("decode plan"):
                        plan = decode_plan(payload)
                    with phase("launch"):
                        pending.append(self.runner.launch(plan))
                except Exception:  # noqa: BLE001 - reported to the driver, which decides
                    pending.append(_describe(self.runner.rank))
        finally:
            stop_step_loop(self.runner.device)
            if prof is not None:
                prof.close()

    def _reply(self, chan: Channel, launched, prof: Optional[StepProfiler]) -> None:
        with phase("reply"):
            self._send_reply(chan, launched)
        if prof is not None:
            prof.on_reply()

    def _send_reply(self, chan: Channel, launched) -> None:
        if isinstance(launched, str):  # the launch failed: its error, in its turn
            chan.send(ERROR, launched.encode())
            return
        try:
            with phase("finish"):
                result = self.runner.finish(launched)
            with phase("encode reply"):
                result = encode(result)
        except Exception:  # noqa: BLE001
            chan.send(ERROR, _describe(self.runner.rank).encode())
            return
        with phase("send reply"):
            chan.send(RESULT, result)


def _describe(rank: int) -> str:
    return f"stage rank {rank} failed:\n{traceback.format_exc()}"
