"""How the engine core reaches its ranks: plans out, one reply per plan per rank back, in
plan order.

ChannelRanks talks to stage actors over their TCP channels (ray_runtime/channel.py);
LocalRanks runs one StageRunner in this process (PP=1), so that tests and benchmarks drive
the real engine core without Ray.
"""
from __future__ import annotations

import select
import time
from collections import deque
from typing import Optional, Protocol

from ray_runtime.channel import ERROR, PLAN, STOP, ChannelClosed, StageError
from ray_runtime.messages import StageStepResult, decode_plan, decode_result

DRAIN_TIMEOUT_S = 30.0  # after a failed step: how long the other ranks get to answer


class RankLink(Protocol):
    broken: Optional[str]  # why the ranks cannot take another plan, or None

    def send_plan(self, plan: bytes) -> None: ...

    def read_replies(self, step_id: int) -> list[StageStepResult]: ...

    def drain(self, num_inflight: int, broken: BaseException) -> None: ...

    def abandon(self) -> None: ...  # drop the link without a word: its ranks are being replaced

    def close(self) -> None: ...


class ChannelRanks:
    def __init__(self, channels: list, step_timeout_s: float) -> None:
        self.channels = channels
        self.step_timeout_s = step_timeout_s
        self.broken: Optional[str] = None

    def send_plan(self, plan: bytes) -> None:
        for chan in self.channels:
            chan.send(PLAN, plan)

    def read_replies(self, step_id: int) -> list[StageStepResult]:
        """The oldest step's reply from every rank, in rank order. Replies are taken as they
        come, so a rank whose channel closes (its process died) is seen at once, whichever
        rank it is; past the step deadline, the first rank still silent is named (the ranks
        after it wait on its activations)."""
        pending = dict(enumerate(self.channels))
        replies: list = [None] * len(self.channels)
        deadline = time.monotonic() + self.step_timeout_s
        while pending:
            left = deadline - time.monotonic()
            ready = select.select([c.sock for c in pending.values()], [], [], left)[0] \
                if left > 0 else []
            if not ready:
                rank = min(pending)
                raise TimeoutError(f"{pending[rank].peer}: no reply within "
                                   f"{self.step_timeout_s:.1f}s to step {step_id} (step_timeout_s)")
            for rank in sorted(pending):
                if pending[rank].sock in ready:
                    replies[rank] = pending.pop(rank).recv()
        errors = [payload.decode() for kind, payload in replies if kind == ERROR]
        if errors:
            raise StageError("\n".join(errors))
        return [decode_result(payload) for _, payload in replies]

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

    def abandon(self) -> None:
        self.broken = self.broken or "abandoned: the stages are being replaced"
        for chan in self.channels:
            chan.close()

    def close(self) -> None:
        for chan in self.channels:
            try:
                chan.send(STOP)
            except (ChannelClosed, OSError):
                pass
            chan.close()


class LocalRanks:
    """One StageRunner (PP=1) in this process. overlap=True is the stage loop's order: a plan
    is launched as soon as it is sent, before the previous step is finished; overlap=False
    finishes every step before the next is launched (the serial baseline)."""

    def __init__(self, runner, overlap: bool = True) -> None:
        self.runner = runner
        self.overlap = overlap
        self.broken: Optional[str] = None
        self._launched: deque = deque()  # a LaunchedStep, a result, or a launch's exception
        self.num_launched = 0

    def send_plan(self, plan: bytes) -> None:
        if not self.overlap and self._launched and not isinstance(self._launched[-1], Exception):
            self._launched[-1] = self.runner.finish(self._launched[-1])
        self.num_launched += 1
        try:
            self._launched.append(self.runner.launch(decode_plan(plan)))
        except Exception as e:  # noqa: BLE001 - replied in order, as the stage loop does
            self._launched.append(e)

    def read_replies(self, step_id: int) -> list[StageStepResult]:
        step = self._launched.popleft()
        if isinstance(step, Exception):
            raise StageError(f"stage rank 0 failed: {step!r}") from step
        return [step if isinstance(step, StageStepResult) else self.runner.finish(step)]

    def drain(self, num_inflight: int, broken: BaseException) -> None:
        for _ in range(num_inflight):
            step = self._launched.popleft()
            if not isinstance(step, (Exception, StageStepResult)):
                self.runner.finish(step)

    def abandon(self) -> None:
        self._launched.clear()

    def close(self) -> None:
        self._launched.clear()
