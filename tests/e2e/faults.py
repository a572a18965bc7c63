"""Fault hooks for the reconciliation tests: each runs inside one stage actor right after a
plan is applied (`StageRunner.fault_hook`) and corrupts that rank's bookkeeping once."""
from __future__ import annotations

import json

from stages.input_batch import InputBatch


class _Once:
    def __init__(self, log_path: str, min_step: int = 4) -> None:
        self.log_path = log_path
        self.min_step = min_step
        self.fired = False

    def _target(self, batch: InputBatch, plan):
        """A request in mid-decode or mid-prefill that this plan runs, with some history."""
        for d in plan.cached_reqs:
            row = batch.req_id_to_slot[d.req_id]
            if batch.num_tokens_known[row] > 8 and d.num_computed_tokens > 4:
                return d.req_id, row
        return None

    def __call__(self, batch: InputBatch, plan) -> None:
        if self.fired or plan.step_id < self.min_step:
            return
        target = self._target(batch, plan)
        if target is None:
            return
        self.fired = True
        req_id, row = target
        what = self.corrupt(batch, row)
        with open(self.log_path, "w") as f:
            json.dump({"step": plan.step_id, "req_id": req_id, "what": what}, f)


class CorruptToken(_Once):
    def corrupt(self, batch: InputBatch, row: int) -> str:
        batch.token_ids[row, 3] = (batch.token_ids[row, 3] + 1) % 100 + 3
        return "token 3"


class CorruptComputedCounter(_Once):
    def corrupt(self, batch: InputBatch, row: int) -> str:
        batch.num_computed_tokens[row] -= 1
        return "num_computed_tokens"


class PlantSeed1Bug:
    """vLLM's PR 41133 bug, planted: a non-last rank sets its known-prefix counter from
    num_computed_tokens + len(new_token_ids). During chunked prefill that shrinks it."""

    def __call__(self, batch: InputBatch, plan) -> None:
        for d in plan.cached_reqs:
            row = batch.req_id_to_slot[d.req_id]
            batch.num_tokens_known[row] = d.num_computed_tokens + len(d.new_token_ids)


class RaiseAtStep:
    """Raise inside the stage at the first plan with step_id >= `step` (once)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.fired = False

    def __call__(self, batch: InputBatch, plan) -> None:
        if not self.fired and plan.step_id >= self.step:
            self.fired = True
            raise RuntimeError(f"injected fault at step {plan.step_id}")


class ExitAtStep:
    """The stage's process dies (os._exit) at the first plan with step_id >= `step`: as a
    crash or a lost node looks to the driver."""

    def __init__(self, step: int) -> None:
        self.step = step

    def __call__(self, batch: InputBatch, plan) -> None:
        if plan.step_id >= self.step:
            import os

            os._exit(1)


class StallAtStep:
    """The stage sleeps `seconds` at the first plan with step_id >= `step` (once)."""

    def __init__(self, step: int, seconds: float) -> None:
        self.step, self.seconds, self.fired = step, seconds, False

    def __call__(self, batch: InputBatch, plan) -> None:
        if not self.fired and plan.step_id >= self.step:
            self.fired = True
            import time

            time.sleep(self.seconds)


class SlowSteps:
    """The stage sleeps `seconds` after every plan: a request lasts long enough for a test to
    act on it mid-run (a client hang-up) however fast the machine steps."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, batch: InputBatch, plan) -> None:
        import time

        time.sleep(self.seconds)
