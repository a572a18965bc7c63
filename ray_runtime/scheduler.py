"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

There are no prefill or decode phases: each step, every running request's computed count
catches up with its known tokens as far as the budget allows, oldest first; then waiting
requests are admitted. A request with a step in flight is not scheduled again until that
step's result is back, so nothing assumes that step N's tokens are known when step N+1 is
planned.
"""
from __future__ import annotations

from collections import deque
from typing import Optional

from ray_runtime.kv_blocks import BlockManager
from ray_runtime.messages import CachedRequestData, NewRequestData, SamplerOutput, StepPlan
from ray_runtime.request import Request, RequestStatus


class Scheduler:
    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, num_kv_blocks: int,
                 block_size: int, max_model_len: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.blocks = BlockManager(num_kv_blocks, block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._inflight: dict[str, int] = {}  # req_id -> step id of its in-flight step
        self._removed_since_last_plan: list[str] = []
        self._next_step_id = 0
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_scheduled_tokens_total = 0

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
    def schedule(self) -> Optional[StepPlan]:
        """The next step's plan, or None when nothing can run now."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        new_reqs: list[NewRequestData] = []
        cached: list[CachedRequestData] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if req.req_id in self._inflight or num_new <= 0:
                i += 1
                continue
            while not self.blocks.can_allocate(req.req_id, req.num_computed_tokens + num_new):
                victim = self._pick_victim()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # req preempted itself: nothing later in `running` can fit either
            new_blocks = self.blocks.allocate(req.req_id, req.num_computed_tokens + num_new)
            cached.append(CachedRequestData(
                req_id=req.req_id, new_token_ids=req.token_ids[req.num_tokens_sent:],
                new_block_ids=new_blocks, num_computed_tokens=req.num_computed_tokens))
            req.num_tokens_sent = req.num_tokens
            scheduled.append((req, num_new))
            budget -= num_new
            i += 1

        # Admitting after a preemption in the same step would only thrash.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            num_new = min(req.num_tokens, budget)
            if not self.blocks.can_allocate(req.req_id, num_new):
                if not self.running:
                    raise RuntimeError(
                        f"request {req.req_id!r} needs more KV blocks than the whole pool "
                        f"({self.blocks.num_blocks} blocks of {self.blocks.block_size}); "
                        "raise num_kv_blocks")
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.incarnation += 1
            req.num_computed_tokens = 0
            self.running.append(req)
            new_blocks = self.blocks.allocate(req.req_id, num_new)
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
        for req, n in scheduled:
            req.num_computed_tokens += n
            self._inflight[req.req_id] = step_id
        self.num_steps += 1
        self.num_scheduled_tokens_total += sum(n for _, n in scheduled)
        removed, self._removed_since_last_plan = self._removed_since_last_plan, []
        return StepPlan(step_id=step_id, removed_req_ids=removed, new_reqs=new_reqs,
                        cached_reqs=cached, scheduled_req_ids=[r.req_id for r, _ in scheduled],
                        num_scheduled_tokens=[n for _, n in scheduled])

    def _pick_victim(self) -> Request:
        # The most recently admitted request that has no step in flight loses its KV.
        for req in reversed(self.running):
            if req.req_id not in self._inflight:
                return req
        raise RuntimeError("KV pool exhausted with every running request in flight")

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req.req_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_tokens_sent = 0
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
        self._inflight.pop(req.req_id, None)

    # ---- results -------------------------------------------------------------------------
    def update_from_output(self, plan: StepPlan, out: SamplerOutput) -> None:
        """Commit the last rank's sampled tokens for `plan`. A result for a request that was
        finished, aborted or re-admitted since (older incarnation) is dropped."""
        for req_id in plan.scheduled_req_ids:
            if self._inflight.get(req_id) == plan.step_id:
                del self._inflight[req_id]
        for i, (req_id, incarnation, tokens) in enumerate(
                zip(out.req_ids, out.incarnations, out.sampled_token_ids)):
            req = self.requests.get(req_id)
            if req is None or req.is_finished or req.incarnation != incarnation \
                    or req.status is not RequestStatus.RUNNING:
                continue
            if out.logprob_token_ids is not None and out.logprob_token_ids[i]:
                req.logprobs.append((dict(zip(out.logprob_token_ids[i], out.logprobs[i])),
                                     out.num_logprob_ranks[i]))
            for tok in tokens:
                req.append_output_token(tok, self.max_model_len)
                self.num_generated_tokens += 1
                if req.is_finished:
                    self._retire(req)
                    break

    def check(self) -> None:
        self.blocks.check()
        assert len(self.running) <= self.max_num_seqs
        for req in self.running:
            assert req.status is RequestStatus.RUNNING
            assert 0 <= req.num_computed_tokens <= req.num_tokens, req.req_id
            assert req.num_tokens_sent <= req.num_tokens
        for req in self.waiting:
            assert req.status is RequestStatus.WAITING and req.num_computed_tokens == 0
