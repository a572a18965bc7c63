"""What the driver keeps of each launched plan: the plan, and per scheduled request what it
expects of the step (its incarnation, the drafts it verifies, the audit's view). The
scheduler makes them (ray_runtime/scheduler.py); the engine core commits against them and the
audit (ray_runtime/reconcile.py) checks every rank's digests against their expectations."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Optional

import msgspec

from ray_runtime.messages import StepPlan


class Expectation(msgspec.Struct, gc=False):
    """The driver's view of one request when a plan left, for the reconciliation audit.
    (A Struct of ints: built for every scheduled request of every step, so it must be cheap.)"""

    incarnation: int
    num_tokens_known: int
    token_hash: int  # over the known prefix and this step's drafts
    num_computed_tokens: int  # before the step
    num_draft_tokens: int = 0


class PlanRecord:
    """A launched plan and what the driver expects of it, per scheduled request."""

    __slots__ = ("plan", "expected", "sampling", "self_drafted")

    def __init__(self, plan: Optional[StepPlan], expected: dict[str, Expectation],
                 sampling: set[str], self_drafted: Optional[set[str]] = None) -> None:
        self.plan = plan
        # Every scheduled request, in plan order: its incarnation, the drafts this step
        # verifies (num_draft_tokens) and the audit's view.
        self.expected = expected
        self.sampling = sampling  # requests this step will sample a token for
        # Self-drafted requests whose expectation is not corrected yet (their previous step has
        # not returned, or its result was dropped: then so is this one's, unaudited).
        self.self_drafted = set() if self_drafted is None else self_drafted

    @property
    def incarnations(self) -> Mapping[str, int]:
        """Of every scheduled request: a read-only view of `expected`."""
        return _ExpectationField(self.expected, "incarnation")

    @property
    def num_drafts(self) -> Mapping[str, int]:
        """Drafts verified per scheduled request: a read-only view of `expected`."""
        return _ExpectationField(self.expected, "num_draft_tokens")


class _ExpectationField(Mapping):
    """One field of every Expectation of a record, as a read-only mapping by request id."""

    __slots__ = ("_expected", "_field")

    def __init__(self, expected: dict[str, Expectation], field: str) -> None:
        self._expected = expected
        self._field = field

    def __getitem__(self, req_id: str) -> int:
        return getattr(self._expected[req_id], self._field)

    def __iter__(self) -> Iterator[str]:
        return iter(self._expected)

    def __len__(self) -> int:
        return len(self._expected)

    def __repr__(self) -> str:
        return repr(dict(self))
