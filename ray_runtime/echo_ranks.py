"""A RankLink with no model: ranks that keep only the bookkeeping a real rank reports.

EchoRanks lets the engine core run its whole step (schedule, encode, send, read replies,
audit, commit, report deltas) at any scale without a model, so that the driver's own host
cost per step can be measured and tested (bench/driver_cost.py,
tests/ray_runtime/test_driver_cost.py). Per request it keeps, from the plans alone, what a
rank's slot keeps: incarnation, the known tokens (and their running hash,
ray_runtime/request.py's hash_extend), the computed count. It answers each plan with one
digest per scheduled request from that state (so the core's audit checks the driver's plans
against an independent reading of them) and, on the last rank, one token (`token_id`) per
request that reaches the end of its known prefix. Replies are msgpack-encoded as a stage
would send them; read_replies decodes them, as ChannelRanks does on the driver's side.

`rank_s` is the time spent being the ranks (decoding and applying the plan, digests,
sampling, encoding the replies): not the driver's cost. Drafts (speculative decoding) are
not modelled: a plan carrying any is refused.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Optional

from ray_runtime.messages import (RowDigests, SamplerOutput, StageStepResult, StageTiming,
                                  StepPlan, decode_plan, decode_result, encode)
from ray_runtime.request import hash_extend, prefix_hash


class _Row:
    """One request's slot, as far as the digests see it."""

    __slots__ = ("incarnation", "tokens", "hash", "computed")

    def __init__(self, incarnation: int, tokens: list[int], computed: int) -> None:
        self.incarnation = incarnation
        self.tokens = tokens
        self.hash = prefix_hash(tokens)
        self.computed = computed

    def write(self, start: int, new: list[int]) -> None:
        """The driver's tokens [start, start + len(new)); below the end: a rewrite."""
        tokens = self.tokens
        if start < len(tokens):
            del tokens[start:]
            self.hash = prefix_hash(tokens)
        elif start > len(tokens):
            raise AssertionError(f"plan writes at {start} past the row's {len(tokens)} tokens")
        self.hash = hash_extend(self.hash, start, new)
        tokens.extend(new)


class EchoRanks:
    """`num_ranks` ranks that agree with every plan; see the module docstring."""

    def __init__(self, num_ranks: int = 1, token_id: int = 7) -> None:
        if not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"num_ranks must be an integer >= 1, got {num_ranks!r}")
        self.num_ranks = num_ranks
        self.token_id = token_id
        self.broken: Optional[str] = None
        self.rank_s = 0.0  # time spent as the ranks, not the driver's
        self.num_plans = 0
        self.last_sent_plan: Optional[StepPlan] = None
        self.last_sent_nbytes = 0
        self.last_read_plan: Optional[StepPlan] = None  # the plan of the last replies read
        self._rows: dict[str, _Row] = {}
        self._replies: deque[tuple[StepPlan, list[bytes]]] = deque()

    @property
    def num_rows(self) -> int:
        """Requests the ranks hold a slot for."""
        return len(self._rows)

    def send_plan(self, plan: bytes) -> None:
        t0 = time.perf_counter()
        p = decode_plan(plan)
        rows = self._rows
        for req_id in p.removed_req_ids:
            rows.pop(req_id, None)  # unknown: aborted before any plan reached the ranks
        for r in p.new_reqs:
            rows[r.req_id] = _Row(r.incarnation, list(r.token_ids), r.num_computed_tokens)
        for c in p.cached_reqs:
            if c.draft_token_ids or c.self_drafted:
                raise NotImplementedError(
                    f"EchoRanks does not model drafts (request {c.req_id!r} in step "
                    f"{p.step_id}): run it without speculative_config")
            if c.new_token_ids:
                rows[c.req_id].write(c.token_start, c.new_token_ids)
        d_inc, d_known, d_computed, d_hash = [], [], [], []
        sampled: list[str] = []
        incarnations: list[int] = []
        for req_id, n in zip(p.scheduled_req_ids, p.num_scheduled_tokens):
            row = rows[req_id]
            known = len(row.tokens)
            d_inc.append(row.incarnation)
            d_known.append(known)
            d_computed.append(row.computed)
            d_hash.append(row.hash)
            row.computed += n
            if row.computed >= known:  # reached the end of its known prefix: samples
                sampled.append(req_id)
                incarnations.append(row.incarnation)
        zeros = [0] * len(d_inc)
        digests = RowDigests(list(p.scheduled_req_ids), d_inc, d_known, list(d_known), d_computed,
                             d_hash, zeros, list(zeros))
        now = time.time()
        timing = StageTiming(now, now, now, now, 0.0)
        last = self.num_ranks - 1
        out = SamplerOutput(p.step_id, sampled, incarnations,
                            [[self.token_id] for _ in sampled])
        self._replies.append((p, [encode(StageStepResult(p.step_id, rank, timing, digests,
                                                         out if rank == last else None))
                                  for rank in range(self.num_ranks)]))
        self.num_plans += 1
        self.last_sent_plan = p
        self.last_sent_nbytes = len(plan)
        self.rank_s += time.perf_counter() - t0

    def read_replies(self, step_id: int) -> list[StageStepResult]:
        plan, payloads = self._replies.popleft()
        if plan.step_id != step_id:
            raise AssertionError(f"replies of step {plan.step_id} read as step {step_id}")
        self.last_read_plan = plan
        return [decode_result(b) for b in payloads]

    def drain(self, num_inflight: int, broken: BaseException) -> None:
        for _ in range(num_inflight):
            self._replies.popleft()

    def abandon(self) -> None:
        self._replies.clear()

    def close(self) -> None:
        self._replies.clear()
