"""A stage's long-running step loop: plans in, results out, over the driver's channel.

The loop runs in its own thread of the stage actor, so no Ray call sits on the step path.
It launches a plan as soon as it arrives; when the next plan is already waiting it launches
that one before finishing the current step, so the host's work on plan N+1 (applying it,
staging inputs, queueing kernels) overlaps the device's work on step N. Every plan gets
exactly one reply, in plan order: its result, or the error that stopped it.
"""
from __future__ import annotations

import threading
import traceback
from typing import Optional

from ray_runtime.channel import ERROR, PLAN, RESULT, STOP, Channel, ChannelClosed, Listener
from ray_runtime.messages import decode_plan, encode

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
        pending = None  # a launched step whose device work was still running
        while True:
            if pending is not None:
                # Reply as soon as the step's device work is done, unless the next plan
                # comes first: then launch that one before replying, to keep the device fed.
                while not chan.readable(_POLL_S):
                    if self.runner.step_done(pending):
                        self._reply(chan, pending)
                        pending = None
                        break
            kind, payload = chan.recv()
            if kind == STOP:
                if pending is not None:
                    self._reply(chan, pending)
                return
            assert kind == PLAN, f"unexpected frame kind {kind}"
            try:
                launched = self.runner.launch(decode_plan(payload))
            except Exception:  # noqa: BLE001 - reported to the driver, which decides
                launched = None
                error = _describe(self.runner.rank)
            if pending is not None:
                self._reply(chan, pending)
                pending = None
            if launched is None:
                chan.send(ERROR, error.encode())
            elif self.runner.step_done(launched):  # a ready result is never held back
                self._reply(chan, launched)
            else:
                pending = launched

    def _reply(self, chan: Channel, launched) -> None:
        try:
            result = encode(self.runner.finish(launched))
        except Exception:  # noqa: BLE001
            chan.send(ERROR, _describe(self.runner.rank).encode())
            return
        chan.send(RESULT, result)


def _describe(rank: int) -> str:
    return f"stage rank {rank} failed:\n{traceback.format_exc()}"
