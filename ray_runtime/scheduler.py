"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

There are no prefill or decode phases: each step, every running request's computed count
catches up with its known tokens as far as the budget allows, oldest first; then waiting
requests are admitted. Nothing assumes that step N's tokens are known when step N+1 is
planned: a request may be planned again while a step of it is in flight when
  - the tokens it needs are known already (the next chunk of a prefill: every stage runs
    plans in order, so the earlier chunk's KV is in place first), or
  - placeholders are allowed (PP=1 async): its one pending sample is the input, which the
    single rank appends to its own row before it runs the next plan.
Otherwise (PP>1) it waits for its token: each request then decodes every few steps and the
micro-batches of different requests interleave in the pipeline.

Speculative decoding: the last rank returns a proposal of drafts with each sample. A decode
step of that request then runs 1 + m tokens (its last token and the m drafts); the driver
counts them all as computed when it plans (optimistic: every draft accepted) and, when the
result arrives, takes back the rejected ones and the KV blocks they no longer need.
With placeholders (PP=1 async) a request's next step is planned before its drafts are
known: it is "self-drafted", planned for 1 + k tokens, and the rank runs its own
accepted tokens and its own new drafts (1 + m' <= 1 + k tokens). When the previous step's
result arrives, the driver learns m' and corrects that in-flight record (its count, its
audit expectation) before that step's own result is read.
Draft counts depend on the budget: a request's drafts are trimmed to what is left of it
(sync, PP>1) and a self-drafted step is only planned when 1 + k tokens fit (PP=1 async), so
sync and async verify the same drafts when the budget does not bind.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from ray_runtime.digest import extend_hash
from ray_runtime.kv_blocks import BlockManager
from ray_runtime.messages import (
    CachedRequestData,
    NewRequestData,
    SamplerOutput,
    StepPlan,
)
from ray_runtime.request import Request, RequestStatus


@dataclass
class Expectation:
    """The driver's view of one request when a plan left, for the reconciliation audit."""

    incarnation: int
    num_tokens_known: int
    token_hash: int  # over the known prefix and this step's drafts
    num_computed_tokens: int  # before the step
    num_draft_tokens: int = 0


@dataclass
class PlanRecord:
    plan: StepPlan
    incarnations: dict[str, int]  # of every scheduled request
    sampling: set[str]  # requests this step will sample a token for
    expected: dict[str, Expectation]
    num_drafts: dict[str, int] = field(default_factory=dict)  # drafts verified per request
    # Self-drafted requests whose expectation is not corrected yet (their previous step has
    # not returned, or its result was dropped: then so is this one's, unaudited).
    self_drafted: set[str] = field(default_factory=set)


class Scheduler:
    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, num_kv_blocks: int,
                 block_size: int, max_model_len: int, allow_placeholders: bool = False,
                 num_speculative_tokens: int = 0) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.allow_placeholders = allow_placeholders
        # KV slots reserved past a step's tokens: the draft model writes its drafts' KV there.
        self.num_lookahead = num_speculative_tokens
        self.blocks = BlockManager(num_kv_blocks, block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._removed_since_last_plan: list[str] = []
        self._next_step_id = 0
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_scheduled_tokens_total = 0
        self.num_placeholder_tokens = 0
        self.num_dropped_samples = 0  # late results: request finished, re-admitted or audited
        # Speculative decoding, as vLLM counts it: steps that verified drafts, drafts
        # verified, drafts accepted, and accepted per draft position.
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_num_accepted_tokens_per_pos = [0] * num_speculative_tokens
        self.num_rolled_back_blocks = 0

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        assert req.req_id not in self.requests, f"duplicate request id {req.req_id!r}"
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def abort_request(self, req_id: str) -> None:
        req = self.requests.get(req_id)
        if req is None or req.is_finished:
            return
        req.abort()
        self._retire(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def pop_finished(self) -> list[Request]:
        done = [r for r in self.requests.values() if r.is_finished]
        for r in done:
            del self.requests[r.req_id]
        return done

    # ---- planning ------------------------------------------------------------------------
    def schedule(self) -> Optional[PlanRecord]:
        """The next step's plan, or None when nothing can run now."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        chosen: set[str] = set()
        new_reqs: list[NewRequestData] = []
        cached: list[CachedRequestData] = []
        drafts_of: dict[str, list[int]] = {}
        self_drafted_reqs: list[Request] = []
        preempted = False

        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = req.num_tokens - req.num_computed_tokens
            drafts: list[int] = []
            self_drafted = False
            if num_new <= 0:
                if not self._can_placeholder(req):
                    continue
                num_new = 1
                if self.num_lookahead:
                    if budget < 1 + self.num_lookahead:
                        continue
                    num_new, self_drafted = 1 + self.num_lookahead, True
            elif num_new == 1 and req.draft_token_ids and req.num_inflight_steps == 0:
                drafts = req.draft_token_ids[:budget - 1]
                num_new += len(drafts)
            num_new = min(num_new, budget)
            fits = True
            while not self.blocks.can_allocate(req.req_id, self._kv_target(req, num_new)):
                victim = self._pick_victim(chosen)
                if victim is None:
                    fits = False
                    break
                if victim is req and len(self.running) == 1:
                    raise self._too_big(req, self._kv_target(req, num_new))
                self._preempt(victim)
                preempted = True
                if victim is req:
                    fits = False
                    break
            if not fits:
                break  # later requests are younger: they would only preempt older ones
            block_start = self.blocks.num_owned(req.req_id)
            new_blocks = self.blocks.allocate(req.req_id, self._kv_target(req, num_new))
            cached.append(CachedRequestData(
                req_id=req.req_id, token_start=req.num_tokens_sent,
                new_token_ids=req.token_ids[req.num_tokens_sent:], new_block_ids=new_blocks,
                num_computed_tokens=req.num_computed_tokens, block_start=block_start,
                draft_token_ids=drafts, self_drafted=self_drafted))
            req.num_tokens_sent = req.num_tokens
            req.draft_token_ids = []  # spent: the next proposal comes with this step's result
            drafts_of[req.req_id] = drafts
            if self_drafted:
                self_drafted_reqs.append(req)
            scheduled.append((req, num_new))
            chosen.add(req.req_id)
            budget -= num_new

        # Admitting after a preemption in the same step would only thrash.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            req.num_computed_tokens = 0
            whole = self._kv_target(req, req.num_tokens)
            if self.blocks.blocks_needed(req.req_id, whole) > self.blocks.num_blocks:
                raise self._too_big(req, whole)
            num_new = min(req.num_tokens, budget)
            if not self.blocks.can_allocate(req.req_id, self._kv_target(req, num_new)):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.incarnation += 1
            req.draft_token_ids = []
            self.running.append(req)
            new_blocks = self.blocks.allocate(req.req_id, self._kv_target(req, num_new))
            new_reqs.append(NewRequestData(
                req_id=req.req_id, incarnation=req.incarnation, token_ids=list(req.token_ids),
                num_prompt_tokens=req.num_prompt_tokens, num_computed_tokens=0,
                block_ids=new_blocks, sampling=req.sampling))
            req.num_tokens_sent = req.num_tokens
            scheduled.append((req, num_new))
            budget -= num_new

        if not scheduled:
            return None
        step_id = self._next_step_id
        self._next_step_id += 1
        record = PlanRecord(plan=None, incarnations={}, sampling=set(), expected={},
                            self_drafted={r.req_id for r in self_drafted_reqs})
        for req in self_drafted_reqs:
            req.self_drafted_record = record
        for req, n in scheduled:
            drafts = drafts_of.get(req.req_id, [])
            record.num_drafts[req.req_id] = len(drafts)
            record.expected[req.req_id] = Expectation(
                req.incarnation, req.num_tokens,
                extend_hash(req.token_hash, req.num_tokens, drafts) if drafts else req.token_hash,
                req.num_computed_tokens, len(drafts))
            record.incarnations[req.req_id] = req.incarnation
            if req.num_computed_tokens >= req.num_tokens:
                self.num_placeholder_tokens += n
            req.num_computed_tokens += n
            req.num_inflight_steps += 1
            if req.num_computed_tokens >= req.num_tokens:
                record.sampling.add(req.req_id)
                req.num_pending_samples += 1
        self.num_steps += 1
        self.num_scheduled_tokens_total += sum(n for _, n in scheduled)
        removed, self._removed_since_last_plan = self._removed_since_last_plan, []
        record.plan = StepPlan(step_id=step_id, removed_req_ids=removed, new_reqs=new_reqs,
                               cached_reqs=cached, scheduled_req_ids=[r.req_id for r, _ in scheduled],
                               num_scheduled_tokens=[n for _, n in scheduled])
        return record

    def _too_big(self, req: Request, num_tokens: int) -> RuntimeError:
        return RuntimeError(
            f"request {req.req_id!r} needs more KV blocks than the whole pool for {num_tokens} "
            f"tokens ({self.blocks.num_blocks} blocks of {self.blocks.block_size}); "
            "raise num_kv_blocks")

    def _kv_target(self, req: Request, num_new: int) -> int:
        """Tokens whose KV slots a step of num_new tokens needs: its own, plus the lookahead
        that the draft model writes after it (never past max_model_len)."""
        return min(req.num_computed_tokens + num_new + self.num_lookahead, self.max_model_len)

    def _can_placeholder(self, req: Request) -> bool:
        """One step ahead of the sampler, never past what max_tokens or the context allow."""
        k = self.num_lookahead
        return (self.allow_placeholders and req.num_pending_samples == 1
                and req.num_inflight_steps == 1
                and req.num_computed_tokens >= req.num_tokens
                and req.num_output_tokens + req.num_pending_samples < req.sampling.max_tokens
                and req.num_computed_tokens + 1 + 2 * k < self.max_model_len)

    def _pick_victim(self, chosen: set[str]) -> Optional[Request]:
        # The most recently admitted request with no step in flight and none in this plan.
        for req in reversed(self.running):
            if req.num_inflight_steps == 0 and req.req_id not in chosen:
                return req
        return None

    def preempt(self, req_id: str) -> None:
        """Drop a request's KV and rank rows; it is recomputed from the driver's tokens.
        Results of its steps still in flight are dropped by incarnation."""
        req = self.requests.get(req_id)
        if req is not None and req.status is RequestStatus.RUNNING:
            self._preempt(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req.req_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_tokens_sent = 0
        req.num_inflight_steps = 0
        req.num_pending_samples = 0
        req.draft_token_ids = []
        req.self_drafted_record = None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._removed_since_last_plan.append(req.req_id)
        self.waiting.appendleft(req)

    def _retire(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
            self._removed_since_last_plan.append(req.req_id)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.blocks.free(req.req_id)

    # ---- results -------------------------------------------------------------------------
    def update_from_output(self, record: PlanRecord, out: SamplerOutput,
                           discard: frozenset[str] = frozenset()) -> None:
        """Commit the last rank's sampled tokens for a step. A result for a request that was
        finished, aborted or re-admitted since (older incarnation) is dropped, and so are the
        requests in `discard` (found inconsistent by the audit)."""
        for req_id, incarnation in record.incarnations.items():
            req = self.requests.get(req_id)
            if req is not None and req.incarnation == incarnation \
                    and req.status is RequestStatus.RUNNING:
                req.num_inflight_steps -= 1
                if req_id in record.sampling:
                    req.num_pending_samples -= 1
        for i, (req_id, incarnation, tokens) in enumerate(
                zip(out.req_ids, out.incarnations, out.sampled_token_ids)):
            req = self.requests.get(req_id)
            if req is None or req.is_finished or req.incarnation != incarnation \
                    or req.status is not RequestStatus.RUNNING or req_id in discard:
                self.num_dropped_samples += len(tokens)
                continue
            drafted = record.num_drafts.get(req_id, 0)
            verified = drafted if out.num_draft_tokens is None else out.num_draft_tokens[i]
            if verified != drafted:
                raise RuntimeError(f"request {req_id!r}: the last rank verified {verified} drafts "
                                   f"but the plan had {drafted}")
            self._settle_drafts(req, drafted, len(tokens) - 1)
            with_lp = out.logprob_token_ids is not None and bool(out.logprob_token_ids[i])
            for j, tok in enumerate(tokens):
                if with_lp:
                    req.logprobs.append((dict(zip(out.logprob_token_ids[i][j], out.logprobs[i][j])),
                                         out.num_logprob_ranks[i][j]))
                req.append_output_token(tok, self.max_model_len)
                self.num_generated_tokens += 1
                if req.is_finished:
                    self._retire(req)
                    break
            if req.self_drafted_record is record:
                req.self_drafted_record = None
            if not req.is_finished and out.draft_token_ids is not None:
                nxt = req.self_drafted_record
                if nxt is not None:  # the rank already runs these drafts in that step
                    self._correct_self_drafted(req, nxt, list(out.draft_token_ids[i]))
                else:
                    req.draft_token_ids = list(out.draft_token_ids[i])

    def _correct_self_drafted(self, req: Request, record: PlanRecord, drafts: list[int]) -> None:
        """The in-flight self-drafted step of req runs 1 + len(drafts) tokens from the count
        just corrected: fix the driver's count, that record's expectation, and the blocks."""
        unused = self.num_lookahead - len(drafts)
        req.num_computed_tokens -= unused
        record.num_drafts[req.req_id] = len(drafts)
        record.self_drafted.discard(req.req_id)
        record.expected[req.req_id] = Expectation(
            req.incarnation, req.num_tokens,
            extend_hash(req.token_hash, req.num_tokens, drafts), req.num_tokens - 1, len(drafts))
        self.num_rolled_back_blocks += self.blocks.trim(req.req_id, self._kv_target(req, 0))

    def _settle_drafts(self, req: Request, drafted: int, accepted: int) -> None:
        """Correct the optimistic plan: take back the rejected drafts' computed count and
        the KV blocks that only they needed, and count the verdict."""
        if not 0 <= accepted <= drafted:
            raise RuntimeError(f"request {req.req_id!r}: the last rank accepted {accepted} of "
                               f"{drafted} drafts")
        if drafted:
            self.spec_num_drafts += 1
            self.spec_num_draft_tokens += drafted
            self.spec_num_accepted_tokens += accepted
            for pos in range(accepted):
                self.spec_num_accepted_tokens_per_pos[pos] += 1
        rejected = drafted - accepted
        if rejected:
            req.num_computed_tokens -= rejected
            self.num_rolled_back_blocks += self.blocks.trim(req.req_id, self._kv_target(req, 0))

    def check(self) -> None:
        self.blocks.check()
        assert len(self.running) <= self.max_num_seqs
        for req in self.running:
            assert req.status is RequestStatus.RUNNING
            assert 0 <= req.num_computed_tokens <= \
                req.num_tokens + req.num_pending_samples * (1 + self.num_lookahead), req.req_id
            assert req.num_tokens_sent <= req.num_tokens
            assert 0 <= req.num_pending_samples <= req.num_inflight_steps
        for req in self.waiting:
            assert req.status is RequestStatus.WAITING and req.num_computed_tokens == 0
