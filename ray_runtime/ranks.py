"""How the engine core reaches its ranks: plans out, one reply per plan per rank back, in
plan order.

ChannelRanks talks to stage actors over their TCP channels (ray_runtime/channel.py);
LocalRanks runs one StageRunner in this process (PP=1), so that tests and benchmarks drive
the real engine core without Ray.
"""
from __future__ import annotations

from collections import deque
from typing import Optional, Protocol

from ray_runtime.channel import ERROR, PLAN, STOP, ChannelClosed, StageError
from ray_runtime.messages import StageStepResult, decode_plan, decode_result

DRAIN_TIMEOUT_S = 30.0  # after a failed step: how long the other ranks get to answer


class RankLink(Protocol):
    broken: Optional[str]  # why the ranks cannot take another plan, or None

    def send_plan(self, plan: bytes) -> None: ...

    def read_replies(self) -> list[StageStepResult]: ...

    def drain(self, num_inflight: int, broken: BaseException) -> None: ...

    def close(self) -> None: ...


class ChannelRanks:
    def __init__(self, channels: list, step_timeout_s: float) -> None:
        self.channels = channels
        self.step_timeout_s = step_timeout_s
        self.broken: Optional[str] = None

    def send_plan(self, plan: bytes) -> None:
        for chan in self.channels:
            chan.send(PLAN, plan)

    def read_replies(self) -> list[StageStepResult]:
        """The oldest step's reply from every rank, in rank order."""
        results, errors = [], []
        for chan in self.channels:
            kind, payload = chan.recv(timeout_s=self.step_timeout_s)
            if kind == ERROR:
                errors.append(payload.decode())
            else:
                results.append(decode_result(payload))
        if errors:
            raise StageError("\n".join(errors))
        return results

    def drain(self, num_inflight: int, broken: BaseException) -> None:
        """Read and drop the replies of the steps still in flight after a failure. A closed
        or silent channel means replies are out of step with plans: the link is broken."""
        if isinstance(broken, (ChannelClosed, TimeoutError)):
            self.broken = str(broken)
            return
        for _ in range(num_inflight):
            for chan in self.channels:
                try:
                    chan.recv(timeout_s=min(self.step_timeout_s, DRAIN_TIMEOUT_S))
                except (TimeoutError, ChannelClosed) as e:
                    self.broken = str(e)
                    return

    def close(self) -> None:
        for chan in self.channels:
            try:
                chan.send(STOP)
            except ChannelClosed:
                pass
            chan.close()


class LocalRanks:
    """One StageRunner (PP=1) in this process, with the stage loop's order: a plan is
    launched as soon as it is sent, before the previous step is finished."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.broken: Optional[str] = None
        self._launched: deque = deque()  # a LaunchedStep, or the exception its launch raised

    def send_plan(self, plan: bytes) -> None:
        try:
            self._launched.append(self.runner.launch(decode_plan(plan)))
        except Exception as e:  # noqa: BLE001 - replied in order, as the stage loop does
            self._launched.append(e)

    def read_replies(self) -> list[StageStepResult]:
        step = self._launched.popleft()
        if isinstance(step, Exception):
            raise StageError(f"stage rank 0 failed: {step!r}") from step
        return [self.runner.finish(step)]

    def drain(self, num_inflight: int, broken: BaseException) -> None:
        for _ in range(num_inflight):
            step = self._launched.popleft()
            if not isinstance(step, Exception):
                self.runner.finish(step)

    def close(self) -> None:
        self._launched.clear()
