"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

There are no prefill or decode phases: each step, every running request's computed count
catches up with its known tokens as far as the budget allows, oldest first; then waiting
requests are admitted. Nothing assumes that step N's tokens are known when step N+1 is
planned: a request may be planned again while a step of it is in flight when
  - the tokens it needs are known already (the next chunk of a prefill: every stage runs
    plans in order, so the earlier chunk's KV is in place first), or
  - placeholders are allowed (PP=1 async): its one pending sample is the input, which the
    single rank appends to its own row before it runs the next plan.
  - placeholders are allowed at PP>1 too when the last rank feeds its samples straight back
    to rank 0 (EngineConfig.feeds_tokens_back): then the running requests are split into
    `num_lanes` disjoint micro-batches (lanes), each step plans one lane (taking turns), and a
    lane's next step is planned on its pending samples while its running step is still in
    the pipeline. A request joins the lane whose turn admits it, while that lane holds less
    than its fair share of the requests; the turns and the shares are ray_runtime/lanes.py's.
Otherwise (PP>1 with drafts) it waits for its token: each request then decodes every few
steps and the micro-batches of different requests interleave in the pipeline.

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

Cost (bench/driver_cost.py): a step's planning and commit are O(requests it schedules +
running requests + requests that finish), nothing per waiting request: one pass over
`running` builds the plan's deltas and each request's audit expectation (a Struct of ints)
and moves its counts; a committed token extends the request's hash in O(1); finished
requests are kept aside for pop_finished. Empty list fields of a plan share one list.
"""
from __future__ import annotations

from collections import deque
from operator import attrgetter
from typing import Optional

from ray_runtime.kv_blocks import BlockManager
from ray_runtime.lanes import LaneTurns
from ray_runtime.messages import (
    CachedRequestData,
    NewRequestData,
    SamplerOutput,
    StepPlan,
)
from ray_runtime.plan_record import Expectation, PlanRecord
from ray_runtime.request import Request, RequestStatus, hash_extend

_RUNNING = RequestStatus.RUNNING
_FINISHED = RequestStatus.FINISHED
# An empty list field of a plan (tokens, blocks or drafts), shared: plans are read-only to
# every consumer, and a fresh list per field per request per step is measurable churn.
_EMPTY: list[int] = []


class Scheduler:
    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, num_kv_blocks: int,
                 block_size: int, max_model_len: int, allow_placeholders: bool = False,
                 num_speculative_tokens: int = 0, num_lanes: int = 1) -> None:
        self.max_num_seqs = max_num_seqs
        self.num_lanes = num_lanes
        self.lanes = LaneTurns(num_lanes, max_num_seqs)  # whose turn, and each lane's share
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.allow_placeholders = allow_placeholders
        # KV slots reserved past a step's tokens: the draft model writes its drafts' KV there.
        self.num_lookahead = num_speculative_tokens
        self.blocks = BlockManager(num_kv_blocks, block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished: list[Request] = []  # retired since the last pop_finished
        self._num_added = 0
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
        req.add_seq = self._num_added
        self._num_added += 1
        self.waiting.append(req)

    def abort_request(self, req_id: str) -> None:
        req = self.requests.get(req_id)
        if req is None or req.is_finished:
            return
        req.abort()
        self._retire(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def pending_removals(self) -> list[str]:
        """Requests that left the ranks' view since the last plan (the next plan removes them)."""
        return self._removed_since_last_plan

    def has_finished(self) -> bool:
        """Finished requests that pop_finished has not returned yet."""
        return bool(self._finished)

    def pop_finished(self) -> list[Request]:
        """The requests finished since the last call, in the order they were added; they
        leave `requests`. O(finished): no scan of the queue."""
        done = self._finished
        if not done:
            return []
        self._finished = []
        done.sort(key=attrgetter("add_seq"))
        requests = self.requests
        for r in done:
            del requests[r.req_id]
        return done

    # ---- planning ------------------------------------------------------------------------
    def schedule(self) -> Optional[PlanRecord]:
        """The next step's plan, or None when nothing can run now. With lanes, the next lane
        that has something to run; the lanes take turns."""
        if self.num_lanes == 1:
            return self._schedule(None)
        for lane in self.lanes.candidates(self.running):
            record = self._schedule(lane)
            if record is not None:
                self.lanes.planned(lane)
                return record
        return None

    def _schedule(self, lane: Optional[int]) -> Optional[PlanRecord]:
        """A plan of the running requests of `lane` (None: of all) and the admissions."""
        budget = self.max_num_batched_tokens
        k = self.num_lookahead
        mml = self.max_model_len
        allow_placeholders = self.allow_placeholders
        blocks = self.blocks
        block_size = blocks.block_size
        owned_of = blocks.owned_of
        new_reqs: list[NewRequestData] = []
        # The plan's cached requests as columns (ray_runtime/columns.py): the dense ones
        # appended here, the rare ones (blocks, drafts, self-drafting) through add_rare.
        cached = CachedRequestData()
        c_ids, c_starts, c_ntok, c_tokens, c_computed, c_bstarts = (
            cached.req_ids.append, cached.token_starts.append, cached.num_new_tokens.append,
            cached.new_token_ids.extend, cached.num_computed_tokens.append,
            cached.block_starts.append)
        # Per scheduled request, in plan order: the audit's view (its keys are the plan's
        # order), the request and its tokens this step; the requests that will sample.
        expected: dict[str, Expectation] = {}
        reqs: list[Request] = []
        nums: list[int] = []
        sampling: set[str] = set()
        sampling_add = sampling.add
        num_placeholder_tokens = 0
        num_logit_tokens = 0  # the tokens that get logits: each sampling row's last known on
        self_drafted_reqs: list[Request] = []
        preempted = False

        for req in self.running[:]:
            if budget <= 0:
                break
            if req.status is not _RUNNING or (lane is not None and req.lane != lane):
                continue  # preempted earlier in this loop, or another micro-batch's
            computed = req.num_computed_tokens
            token_ids = req.token_ids
            num_tokens = len(token_ids)
            num_new = num_tokens - computed
            drafts = _EMPTY
            self_drafted = False
            if num_new <= 0:
                # A placeholder: one step ahead of the sampler (its one pending sample is
                # this step's input), never past what max_tokens or the context allow.
                if not (allow_placeholders and req.num_pending_samples == 1
                        and req.num_inflight_steps == 1
                        and num_tokens + 1 < req.length_limit  # outputs + pending < max
                        and computed + 1 + 2 * k < mml):
                    continue
                num_new = 1
                if k:
                    if budget < 1 + k:
                        continue
                    num_new, self_drafted = 1 + k, True
            elif num_new == 1 and req.draft_token_ids and req.num_inflight_steps == 0:
                drafts = req.draft_token_ids[:budget - 1]
                num_new += len(drafts)
            if num_new > budget:
                num_new = budget
            target = computed + num_new + k  # _kv_target(req, num_new)
            if target > mml:
                target = mml
            req_id = req.req_id
            owned = owned_of(req_id)
            if owned is not None and -(-target // block_size) <= len(owned):
                block_start, new_blocks = len(owned), _EMPTY  # the common decode step
            else:
                got = blocks.reserve(req_id, target)
                if got is None:
                    fits = True
                    while not blocks.can_allocate(req_id, target):
                        victim = self._pick_victim(expected)
                        if victim is None:
                            fits = False
                            break
                        if victim is req and len(self.running) == 1:
                            self._unplan(reqs, nums, sampling)
                            raise self._too_big(req, target)
                        self._preempt(victim)
                        preempted = True
                        if victim is req:
                            fits = False
                            break
                    if not fits:
                        break  # later requests are younger: they would only preempt older ones
                    got = blocks.reserve(req_id, target)
                block_start, new_blocks = got
            sent = req.num_tokens_sent
            if new_blocks or drafts or self_drafted:
                cached.add_rare(len(cached.req_ids), new_blocks, drafts, self_drafted)
            c_ids(req_id)
            c_starts(sent)
            if sent < num_tokens:
                c_ntok(num_tokens - sent)
                c_tokens(token_ids[sent:])
            else:
                c_ntok(0)
            c_computed(computed)
            c_bstarts(block_start)
            req.num_tokens_sent = num_tokens
            if drafts:
                expected[req_id] = Expectation(
                    req.incarnation, num_tokens, hash_extend(req.token_hash, num_tokens, drafts),
                    computed, len(drafts))
            else:
                expected[req_id] = Expectation(req.incarnation, num_tokens, req.token_hash,
                                               computed, 0)
            if req.draft_token_ids:
                req.draft_token_ids = []  # spent: the next proposal comes with this step's result
            if self_drafted:
                self_drafted_reqs.append(req)
            if computed >= num_tokens:
                num_placeholder_tokens += num_new
            if computed + num_new >= num_tokens:
                num_logit_tokens += computed + num_new - max(computed, num_tokens - 1)
            computed += num_new
            req.num_computed_tokens = computed
            req.num_inflight_steps += 1
            if computed >= num_tokens:
                sampling_add(req_id)
                req.num_pending_samples += 1
            reqs.append(req)
            nums.append(num_new)
            budget -= num_new

        lane_size = share = 0  # a lane admits up to its share (ray_runtime/lanes.py)
        if lane is not None and self.waiting:
            lane_size, share = self.lanes.share(lane, self.running, len(self.waiting))
        # Admitting after a preemption in the same step would only thrash.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs
               and (lane is None or lane_size < share)):
            req = self.waiting[0]
            req.num_computed_tokens = 0
            whole = self._kv_target(req, req.num_tokens)
            if blocks.blocks_needed(req.req_id, whole) > blocks.num_blocks:
                self._unplan(reqs, nums, sampling)
                raise self._too_big(req, whole)
            num_new = min(req.num_tokens, budget)
            if not blocks.can_allocate(req.req_id, self._kv_target(req, num_new)):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.incarnation += 1
            req.draft_token_ids = []
            if lane is not None:
                req.lane = lane
                lane_size += 1
            self.running.append(req)
            new_blocks = blocks.allocate(req.req_id, self._kv_target(req, num_new))
            new_reqs.append(NewRequestData(
                req_id=req.req_id, incarnation=req.incarnation, token_ids=list(req.token_ids),
                num_prompt_tokens=req.num_prompt_tokens, num_computed_tokens=0,
                block_ids=new_blocks, sampling=req.sampling))
            num_tokens = len(req.token_ids)
            req.num_tokens_sent = num_tokens
            expected[req.req_id] = Expectation(req.incarnation, num_tokens, req.token_hash, 0, 0)
            req.num_computed_tokens = num_new
            req.num_inflight_steps += 1
            if num_new >= num_tokens:
                sampling_add(req.req_id)
                req.num_pending_samples += 1
                num_logit_tokens += 1
            reqs.append(req)
            nums.append(num_new)
            budget -= num_new

        if not reqs:
            return None
        step_id = self._next_step_id
        self._next_step_id += 1
        record = PlanRecord(None, expected, sampling,
                            {r.req_id for r in self_drafted_reqs} if self_drafted_reqs else None)
        for req in self_drafted_reqs:
            req.self_drafted_record = record
        self.num_placeholder_tokens += num_placeholder_tokens
        self.num_steps += 1
        num_scheduled = self.max_num_batched_tokens - budget
        self.num_scheduled_tokens_total += num_scheduled
        removed, self._removed_since_last_plan = self._removed_since_last_plan, []
        record.plan = StepPlan(step_id, removed, new_reqs, cached, list(expected), nums,
                               prefill_shaped=2 * num_logit_tokens < num_scheduled)
        return record

    def _unplan(self, reqs: list[Request], nums: list[int], sampling: set[str]) -> None:
        """Planning raises: take back the counts of the requests planned so far in this
        step (what else planning changed stays, as it always has)."""
        for req, n in zip(reqs, nums):
            req.num_computed_tokens -= n
            req.num_inflight_steps -= 1
            if req.req_id in sampling:
                req.num_pending_samples -= 1

    def _too_big(self, req: Request, num_tokens: int) -> RuntimeError:
        return RuntimeError(
            f"request {req.req_id!r} needs more KV blocks than the whole pool for {num_tokens} "
            f"tokens ({self.blocks.num_blocks} blocks of {self.blocks.block_size}); "
            "raise num_kv_blocks")

    def _kv_target(self, req: Request, num_new: int) -> int:
        """Tokens whose KV slots a step of num_new tokens needs: its own, plus the lookahead
        that the draft model writes after it (never past max_model_len)."""
        return min(req.num_computed_tokens + num_new + self.num_lookahead, self.max_model_len)

    def _pick_victim(self, chosen) -> Optional[Request]:
        # The most recently admitted request with no step in flight and none in this plan.
        for req in reversed(self.running):
            if req.num_inflight_steps == 0 and req.req_id not in chosen:
                return req
        return None

    def requeue_all(self) -> int:
        """The ranks were replaced (empty): every running request goes back to the queue, in
        admission order, to be recomputed from its tokens; nothing is left to remove from
        the new ranks. Returns how many were requeued."""
        running = list(self.running)
        for req in reversed(running):  # appendleft: the oldest ends up first
            self._preempt(req)
        self._removed_since_last_plan = []
        return len(running)

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
        self._finished.append(req)

    # ---- results -------------------------------------------------------------------------
    def update_from_output(self, record: PlanRecord, out: SamplerOutput,
                           discard: frozenset[str] = frozenset()) -> None:
        """Commit the last rank's sampled tokens for a step. A result for a request that was
        finished, aborted or re-admitted since (older incarnation) is dropped, and so are the
        requests in `discard` (found inconsistent by the audit)."""
        requests = self.requests
        expected = record.expected
        sampling = record.sampling
        for req_id, exp in expected.items():
            req = requests.get(req_id)
            if req is not None and req.incarnation == exp.incarnation \
                    and req.status is _RUNNING:
                req.num_inflight_steps -= 1
                if req_id in sampling:
                    req.num_pending_samples -= 1
        num_draft_tokens = out.num_draft_tokens
        logprob_token_ids = out.logprob_token_ids
        draft_token_ids = out.draft_token_ids
        mml = self.max_model_len
        num_generated = 0
        # Finished requests leave `running` in one pass at the end (not one list.remove each).
        retired: list[Request] = []
        try:
            for i, (req_id, incarnation, tokens) in enumerate(
                    zip(out.req_ids, out.incarnations, out.sampled_token_ids)):
                req = requests.get(req_id)
                if req is None or req.status is not _RUNNING or req.incarnation != incarnation \
                        or req_id in discard:
                    self.num_dropped_samples += len(tokens)
                    continue
                exp = expected.get(req_id)
                drafted = 0 if exp is None else exp.num_draft_tokens
                if num_draft_tokens is not None and num_draft_tokens[i] != drafted:
                    raise RuntimeError(f"request {req_id!r}: the last rank verified "
                                       f"{num_draft_tokens[i]} drafts but the plan had {drafted}")
                if drafted or len(tokens) != 1:
                    self._settle_drafts(req, drafted, len(tokens) - 1)
                if logprob_token_ids is not None and logprob_token_ids[i]:
                    for j, tok in enumerate(tokens):
                        req.logprobs.append((dict(zip(logprob_token_ids[i][j], out.logprobs[i][j])),
                                             out.num_logprob_ranks[i][j]))
                        req.append_output_token(tok, mml)
                        num_generated += 1
                        if req.status is _FINISHED:
                            self._retire_running(req, retired)
                            break
                elif len(tokens) == 1:  # the common case: one token, no logprobs
                    req.append_output_token(tokens[0], mml)
                    num_generated += 1
                    if req.status is _FINISHED:
                        self._retire_running(req, retired)
                else:
                    for tok in tokens:
                        req.append_output_token(tok, mml)
                        num_generated += 1
                        if req.status is _FINISHED:
                            self._retire_running(req, retired)
                            break
                if req.self_drafted_record is record:
                    req.self_drafted_record = None
                if draft_token_ids is not None and req.status is not _FINISHED:
                    nxt = req.self_drafted_record
                    if nxt is not None:  # the rank already runs these drafts in that step
                        self._correct_self_drafted(req, nxt, list(draft_token_ids[i]))
                    else:
                        req.draft_token_ids = list(draft_token_ids[i])
        finally:
            self.num_generated_tokens += num_generated
            if retired:
                if len(retired) == 1:
                    self.running.remove(retired[0])
                else:
                    self.running[:] = [r for r in self.running if r.status is _RUNNING]

    def _retire_running(self, req: Request, retired: list[Request]) -> None:
        """_retire for a running request that just finished, except that it leaves
        `running` later, with the others of the same result (update_from_output)."""
        self._removed_since_last_plan.append(req.req_id)
        self.blocks.free(req.req_id)
        self._finished.append(req)
        retired.append(req)

    def _correct_self_drafted(self, req: Request, record: PlanRecord, drafts: list[int]) -> None:
        """The in-flight self-drafted step of req runs 1 + len(drafts) tokens from the count
        just corrected: fix the driver's count, that record's expectation, and the blocks."""
        unused = self.num_lookahead - len(drafts)
        req.num_computed_tokens -= unused
        record.self_drafted.discard(req.req_id)
        num_tokens = len(req.token_ids)
        record.expected[req.req_id] = Expectation(
            req.incarnation, num_tokens, hash_extend(req.token_hash, num_tokens, drafts),
            num_tokens - 1, len(drafts))
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

    @property
    def max_lane_size(self) -> int:
        """The most requests one lane holds (what a stage's decode graphs are captured up to)."""
        return self.lanes.max_lane_size

    def check(self) -> None:
        self.blocks.check()
        assert len(self.running) <= self.max_num_seqs
        if self.num_lanes > 1:
            self.lanes.check(self.running)
        for req in self.running:
            assert req.status is RequestStatus.RUNNING
            assert 0 <= req.num_computed_tokens <= \
                req.num_tokens + req.num_pending_samples * (1 + self.num_lookahead), req.req_id
            assert req.num_tokens_sent <= req.num_tokens
            assert 0 <= req.num_pending_samples <= req.num_inflight_steps
        for req in self.waiting:
            assert req.status is RequestStatus.WAITING and req.num_computed_tokens == 0
