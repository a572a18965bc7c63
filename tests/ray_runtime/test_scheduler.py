"""ray_runtime/scheduler.py + kv_blocks.py + request.py, driven directly (no Ray).

A `Harness` plays both the driver's loop and the ranks: it mirrors what ranks would hold
from each plan alone (NewRequestData, then CachedRequestData deltas, removed ids), checks
that mirror against the scheduler's canonical Request objects every step, and answers each
plan with a SamplerOutput for the requests whose computed count reached their known tokens.

`Scheduler.schedule()` returns either the StepPlan itself or a record holding it as `.plan`
(which `update_from_output` then takes back); the harness accepts both.
"""
from __future__ import annotations

import random
from typing import Callable, Optional

import pytest

from ray_runtime.kv_blocks import BlockManager
from ray_runtime.messages import SamplerOutput, StepPlan
from ray_runtime.request import Request, RequestStatus
from ray_runtime.sampling_params import SamplingParams
from ray_runtime.scheduler import Scheduler

EOS = 2


def default_token(req: Request) -> int:
    """Deterministic in (request, output index): recompute after preemption must not matter."""
    return 1000 + 10 * req.arrival_index + req.num_output_tokens


class Harness:
    def __init__(self, *, max_num_seqs: int = 8, budget: int = 64, num_blocks: int = 64,
                 block_size: int = 4, max_model_len: int = 4096,
                 token_fn: Callable[[Request], int] = default_token) -> None:
        self.s = Scheduler(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                           num_kv_blocks=num_blocks, block_size=block_size,
                           max_model_len=max_model_len)
        self.budget = budget
        self.block_size = block_size
        self.token_fn = token_fn
        self.arrivals = 0
        self.all: dict[str, Request] = {}
        # The ranks' view, rebuilt from plans only.
        self.known: dict[str, list[int]] = {}
        self.rank_blocks: dict[str, list[int]] = {}
        self.rank_computed: dict[str, int] = {}
        # Tokens committed since the last plan that named the request.
        self.committed_since: dict[str, list[int]] = {}
        self.plans: list[StepPlan] = []
        self.preempted_log: list[list[str]] = []
        self.records: dict[int, object] = {}  # step_id -> what schedule() returned
        self.samples: dict[int, list[str]] = {}  # step_id -> requests that step samples for
        self.unfed: set[int] = set()  # step ids planned but not answered yet

    def add(self, req_id: str, prompt: list[int], **sp) -> Request:
        req = Request(req_id, prompt, SamplingParams(**sp), frozenset({EOS}), self.arrivals)
        self.arrivals += 1
        self.s.add_request(req)
        self.all[req_id] = req
        return req

    # ---- one driver step ---------------------------------------------------------------
    def schedule(self) -> Optional[StepPlan]:
        rec = self.s.schedule()
        if rec is None:
            return None
        plan = getattr(rec, "plan", rec)
        self.records[plan.step_id] = rec
        self.unfed.add(plan.step_id)
        # Requests that reach the end of their known tokens with this step sample a token.
        self.samples[plan.step_id] = [(rid, self.all[rid].incarnation)
                                      for rid in plan.scheduled_req_ids
                                      if self.all[rid].num_computed_tokens
                                      == self.all[rid].num_tokens]
        return plan

    def step(self, feed: bool = True) -> Optional[StepPlan]:
        running_before = [r.req_id for r in self.s.running]
        preemptions_before = self.s.num_preemptions
        nothing_in_flight = not self.unfed
        plan = self.schedule()
        self.check()
        n_preempted = self.s.num_preemptions - preemptions_before
        if n_preempted and nothing_in_flight:
            # Victims are the most recently admitted: a suffix of the running order.
            victims = running_before[len(running_before) - n_preempted:]
            assert all(self.all[v].status is RequestStatus.WAITING for v in victims), victims
            assert [r.req_id for r in self.s.running] == running_before[:-n_preempted]
            self.preempted_log.append(victims)
        if plan is None:
            return None
        self.plans.append(plan)
        self._apply_plan(plan)
        if feed:
            self.feed(plan)
        return plan

    def output_for(self, plan: StepPlan) -> SamplerOutput:
        ids, incs, toks = [], [], []
        for rid, incarnation in self.samples[plan.step_id]:
            req = self.all[rid]
            ids.append(rid)
            incs.append(incarnation)
            toks.append([self.token_fn(req)])
        return SamplerOutput(step_id=plan.step_id, req_ids=ids, incarnations=incs,
                             sampled_token_ids=toks)

    def feed(self, plan: StepPlan, out: Optional[SamplerOutput] = None) -> SamplerOutput:
        """Answer `plan` (once) with `out`, by default what the last rank would sample."""
        assert plan.step_id in self.unfed, "a plan is answered exactly once"
        out = self.output_for(plan) if out is None else out
        before = {rid: r.num_tokens for rid, r in self.all.items()}
        self.unfed.discard(plan.step_id)
        self.s.update_from_output(self.records[plan.step_id], out)
        for rid, r in self.all.items():
            if r.num_tokens != before[rid]:
                self.committed_since.setdefault(rid, []).extend(r.token_ids[before[rid]:])
        self.check()
        return out

    def run(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.s.has_unfinished():
            assert self.step() is not None, "planned nothing with unfinished requests"
            steps += 1
            assert steps < max_steps, "scheduler does not make progress"
        return steps

    def check(self) -> None:
        self.s.check()
        self.s.blocks.check()
        bm = self.s.blocks
        owned = sum(len(bm.block_ids(r.req_id)) for r in self.s.running)
        assert bm.num_free_blocks + owned == bm.num_blocks  # free + owned == all
        for r in list(self.s.waiting):
            assert bm.block_ids(r.req_id) == [], "a waiting request holds blocks"
        for r in self.all.values():
            if r.is_finished:
                assert bm.block_ids(r.req_id) == [], "a finished request holds blocks"

    # ---- the ranks' mirror ---------------------------------------------------------------
    def _apply_plan(self, plan: StepPlan) -> None:
        s = self.s
        n_sched = plan.num_scheduled_tokens
        assert len(plan.scheduled_req_ids) == len(n_sched) == len(set(plan.scheduled_req_ids))
        assert plan.total_num_scheduled_tokens <= self.budget, "token budget exceeded"
        assert all(n >= 1 for n in n_sched)
        assert len(plan.scheduled_req_ids) <= s.max_num_seqs
        for rid in plan.removed_req_ids:
            assert rid not in plan.scheduled_req_ids or rid in [n.req_id for n in plan.new_reqs]
            self.known.pop(rid, None)
            self.rank_blocks.pop(rid, None)
            self.rank_computed.pop(rid, None)
        plan.check()  # the layout order: the cached requests in order, then the new ones
        named = [c.req_id for c in plan.cached_reqs] + [n.req_id for n in plan.new_reqs]
        assert named == plan.scheduled_req_ids
        for new in plan.new_reqs:
            req = self.all[new.req_id]
            assert new.req_id not in self.known, "NewRequestData for a request the ranks hold"
            assert new.token_ids == req.token_ids  # the whole known prefix
            assert new.num_prompt_tokens == req.num_prompt_tokens
            assert new.incarnation == req.incarnation
            assert new.num_computed_tokens == 0
            assert new.sampling == req.sampling
            self.known[new.req_id] = list(new.token_ids)
            self.rank_blocks[new.req_id] = list(new.block_ids)
            self.rank_computed[new.req_id] = 0
            self.committed_since.pop(new.req_id, None)
        for c in plan.cached_reqs:
            assert c.req_id in self.known, "CachedRequestData for a request the ranks lack"
            if hasattr(c, "token_start"):
                assert c.token_start == len(self.known[c.req_id])
            # Exactly the tokens appended since the previous plan, never the history.
            assert c.new_token_ids == self.committed_since.pop(c.req_id, [])
            assert c.num_computed_tokens == self.rank_computed[c.req_id]
            self.known[c.req_id].extend(c.new_token_ids)
            self.rank_blocks[c.req_id].extend(c.new_block_ids)
        for rid, n in zip(plan.scheduled_req_ids, n_sched):
            req = self.all[rid]
            assert req.status is RequestStatus.RUNNING
            assert self.known[rid] == req.token_ids, "ranks miss tokens of a scheduled request"
            self.rank_computed[rid] += n
            assert self.rank_computed[rid] == req.num_computed_tokens <= req.num_tokens
            assert self.rank_blocks[rid] == s.blocks.block_ids(rid)
            assert len(self.rank_blocks[rid]) == -(-req.num_computed_tokens // self.block_size)
        # Every running request is held by the ranks with the blocks the manager gave it.
        for req in s.running:
            assert self.rank_blocks.get(req.req_id) == s.blocks.block_ids(req.req_id)


def prompt(n: int, start: int = 3) -> list[int]:
    return [start + i % 500 for i in range(n)]


# ---- budget, chunked prefill, max_num_seqs -----------------------------------------------

def test_chunked_prefill_under_budget_while_decode_gets_one_token_per_step():
    """...and a step is prefill-shaped (StepPlan.prefill_shaped) while fewer than half of its
    tokens get logits: a prompt's chunks with a decode row, not the decode rows alone."""
    h = Harness(budget=8, block_size=4, num_blocks=64)
    h.add("dec", prompt(3), max_tokens=40)
    p1 = h.step()
    assert p1.scheduled_req_ids == ["dec"] and p1.num_scheduled_tokens == [3]
    assert p1.prefill_shaped  # 1 of 3 tokens gets logits
    h.add("long", prompt(50), max_tokens=2)
    chunks = []
    long_req = h.all["long"]
    while long_req.num_output_tokens == 0:
        plan = h.step()
        sched = dict(zip(plan.scheduled_req_ids, plan.num_scheduled_tokens))
        assert sched["dec"] == 1, "a decoding request gets exactly one token per step"
        assert plan.scheduled_req_ids[0] == "dec"  # oldest first
        assert plan.total_num_scheduled_tokens <= 8
        # dec's token and, in the last chunk, long's last one get logits
        logits = 1 + (long_req.num_computed_tokens == 50)
        assert plan.prefill_shaped == (2 * logits < plan.total_num_scheduled_tokens)
        chunks.append(sched["long"])
        if long_req.num_computed_tokens < 50:
            assert long_req.num_output_tokens == 0  # mid-prefill samples nothing
    assert sum(chunks) == 50
    assert chunks[:-1] == [7] * (len(chunks) - 1) and 1 <= chunks[-1] <= 7
    assert len(chunks) == 8  # ceil(50 / 7)
    plan = h.step()
    assert dict(zip(plan.scheduled_req_ids, plan.num_scheduled_tokens)) == {"dec": 1, "long": 1}
    assert not plan.prefill_shaped
    h.run()
    assert h.all["long"].num_output_tokens == 2 and h.all["dec"].num_output_tokens == 40


def test_admission_splits_first_chunk_to_remaining_budget():
    h = Harness(budget=10, block_size=4)
    h.add("a", prompt(6))
    h.add("b", prompt(9))
    h.add("c", prompt(5))
    plan = h.step()
    assert plan.scheduled_req_ids == ["a", "b"] and plan.num_scheduled_tokens == [6, 4]
    assert [n.req_id for n in plan.new_reqs] == ["a", "b"]
    # b's NewRequestData carries the whole prompt even though only 4 tokens run now.
    assert plan.new_reqs[1].token_ids == prompt(9)
    plan = h.step()
    assert plan.scheduled_req_ids == ["a", "b", "c"] and plan.num_scheduled_tokens == [1, 5, 4]
    assert plan.cached_reqs[1].new_token_ids == []  # b is mid-prefill: nothing new to send


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3])
def test_max_num_seqs_caps_running(max_num_seqs):
    h = Harness(max_num_seqs=max_num_seqs, budget=64)
    for i in range(7):
        h.add(f"r{i}", prompt(5 + i), max_tokens=3 + i % 3)
    admitted: list[str] = []
    while h.s.has_unfinished():
        plan = h.step()
        assert len(h.s.running) <= max_num_seqs
        assert len(plan.scheduled_req_ids) <= max_num_seqs
        admitted += [n.req_id for n in plan.new_reqs]
    assert admitted == [f"r{i}" for i in range(7)]  # FIFO admission, no preemption
    assert h.s.num_preemptions == 0
    assert all(r.num_output_tokens == r.sampling.max_tokens for r in h.all.values())


@pytest.mark.parametrize("seed", range(10))
def test_random_workload_invariants_hold_every_step(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    num_blocks = rng.randint(24, 72) // block_size
    pool_tokens = num_blocks * block_size
    h = Harness(max_num_seqs=rng.randint(2, 6), budget=rng.randint(3, 40), num_blocks=num_blocks,
                block_size=block_size)
    expected = {}
    for i in range(14):
        max_tokens = rng.randint(1, 10)
        n = rng.randint(1, max(1, min(40, pool_tokens - max_tokens)))
        h.add(f"q{i}", prompt(n, start=3 + i), max_tokens=max_tokens)
        expected[f"q{i}"] = [1000 + 10 * i + k for k in range(max_tokens)]
    h.run()
    assert sum(len(v) for v in h.preempted_log) == h.s.num_preemptions  # all newest-first
    for rid, req in h.all.items():
        assert req.finish_reason == "length"
        assert req.output_token_ids == expected[rid], rid  # preemption lost/duplicated nothing
        assert req.token_ids[:req.num_prompt_tokens] == prompt(req.num_prompt_tokens, 3 + int(rid[1:]))
    assert h.s.blocks.num_free_blocks == num_blocks
    assert not h.s.running and not h.s.waiting
    done = h.s.pop_finished()
    assert sorted(r.req_id for r in done) == sorted(h.all)
    assert h.s.requests == {}


# ---- preemption --------------------------------------------------------------------------

def test_preempts_most_recently_admitted_and_resumes_with_its_tokens():
    # 6 blocks of 4: three 8-token prompts fill the pool exactly.
    h = Harness(budget=64, num_blocks=6, block_size=4)
    for rid in "ABC":
        h.add(rid, prompt(8, start=10 * (ord(rid) - 60)), max_tokens=3)
    p1 = h.step()
    assert p1.scheduled_req_ids == ["A", "B", "C"]
    assert h.s.blocks.num_free_blocks == 0
    c_prompt = list(h.all["C"].token_ids[:8])
    c_first = h.all["C"].output_token_ids
    assert len(c_first) == 1

    p2 = h.step()  # A and B each need a 3rd block: C (most recent) loses its KV
    assert h.s.num_preemptions == 1 and h.all["C"].num_preemptions == 1
    assert p2.removed_req_ids == ["C"]
    assert p2.scheduled_req_ids == ["A", "B"]
    assert p2.new_reqs == []
    c = h.all["C"]
    assert c.status is RequestStatus.WAITING and c.num_computed_tokens == 0
    assert h.s.blocks.block_ids("C") == []
    assert c.output_token_ids == c_first  # the committed output survives preemption

    p3 = h.step()  # A, B finish (3 outputs); no room for C yet
    assert [n.req_id for n in p3.new_reqs] == []
    assert h.all["A"].is_finished and h.all["B"].is_finished

    p4 = h.step()
    assert sorted(p4.removed_req_ids) == ["A", "B"]
    assert [n.req_id for n in p4.new_reqs] == ["C"]
    resumed = p4.new_reqs[0]
    assert resumed.token_ids == c_prompt + c_first  # prompt + generated
    assert resumed.num_prompt_tokens == 8  # unchanged
    assert resumed.incarnation == 2
    assert resumed.num_computed_tokens == 0
    assert p4.num_scheduled_tokens == [9]  # recomputes the whole known prefix
    h.run()
    assert c.output_token_ids == [default_token_at(c, k) for k in range(3)]
    assert c.num_prompt_tokens == 8 and c.finish_reason == "length"
    assert h.s.num_preemptions == 1


def default_token_at(req: Request, k: int) -> int:
    return 1000 + 10 * req.arrival_index + k


def test_preemption_cascades_from_the_back_and_keeps_arrival_order():
    # One long-lived request grows and pushes out the later ones, newest first.
    h = Harness(budget=64, num_blocks=8, block_size=2)
    h.add("old", prompt(4), max_tokens=9)     # grows to 13 tokens = 7 blocks
    for rid in ("m1", "m2", "m3"):
        h.add(rid, prompt(2), max_tokens=6)
    h.step()
    assert len(h.s.running) == 4
    while h.s.has_unfinished():
        h.step()
        # Waiting requests keep arrival order (preempted ones go back to the front).
        waiting = [r.arrival_index for r in h.s.waiting]
        assert waiting == sorted(waiting)
    assert h.s.num_preemptions >= 2
    assert sum(len(v) for v in h.preempted_log) == h.s.num_preemptions
    assert h.preempted_log[0] == ["m3"]  # newest first
    assert h.all["old"].num_preemptions == 0  # the oldest is never the victim
    for rid, req in h.all.items():
        assert req.output_token_ids == [default_token_at(req, k)
                                        for k in range(req.sampling.max_tokens)]


def test_preempted_request_is_not_scheduled_in_the_same_plan():
    h = Harness(budget=64, num_blocks=4, block_size=4)
    h.add("A", prompt(8), max_tokens=5)
    h.add("B", prompt(8), max_tokens=5)
    h.step()
    plan = h.step()
    assert plan.removed_req_ids == ["B"]
    assert "B" not in plan.scheduled_req_ids
    assert plan.new_reqs == []  # no admission in a step that preempted


# ---- deltas ------------------------------------------------------------------------------

def test_cached_reqs_carry_only_new_tokens():
    h = Harness(budget=5, block_size=4)
    h.add("a", prompt(2), max_tokens=6)
    h.add("b", prompt(12), max_tokens=4)
    seen = {"a": [], "b": []}
    while h.s.has_unfinished():
        plan = h.step()
        for c in plan.cached_reqs:
            assert len(c.new_token_ids) <= 1  # one sampled token per step, never the history
            seen[c.req_id] += c.new_token_ids
    # Everything the ranks were sent by deltas is the output except the last token (never
    # needed as an input once the request finished).
    for rid, toks in seen.items():
        assert toks == h.all[rid].output_token_ids[:-1]


# ---- finishing ---------------------------------------------------------------------------

def _seq_token_fn(tokens: dict[str, list[int]]):
    def fn(req: Request) -> int:
        return tokens[req.req_id][req.num_output_tokens]
    return fn


def test_finish_by_max_tokens():
    h = Harness()
    h.add("a", prompt(5), max_tokens=4)
    h.add("b", prompt(5), max_tokens=1)
    h.step()
    assert h.all["b"].is_finished and h.all["b"].finish_reason == "length"
    plan = h.step()
    assert plan.removed_req_ids == ["b"]
    h.run()
    a = h.all["a"]
    assert a.num_output_tokens == 4 and a.finish_reason == "length" and a.stop_reason is None


def test_finish_by_eos_unless_ignore_eos():
    toks = {"e": [7, EOS, 8, 9], "i": [7, EOS, 8, 9]}
    h = Harness(token_fn=_seq_token_fn(toks))
    h.add("e", prompt(4), max_tokens=4)
    h.add("i", prompt(4), max_tokens=4, ignore_eos=True)
    h.run()
    e, i = h.all["e"], h.all["i"]
    assert e.output_token_ids == [7, EOS] and e.finish_reason == "stop" and e.stop_reason is None
    assert i.output_token_ids == [7, EOS, 8, 9] and i.finish_reason == "length"


def test_finish_by_stop_token_ids():
    toks = {"s": [5, 6, 11, 12], "both": [EOS, 1], "ign": [EOS, 13, 1]}
    h = Harness(token_fn=_seq_token_fn(toks))
    h.add("s", prompt(3), max_tokens=4, stop_token_ids=[11, 99])
    h.add("both", prompt(3), max_tokens=4, stop_token_ids=[EOS])  # EOS wins: no stop_reason
    h.add("ign", prompt(3), max_tokens=4, ignore_eos=True, stop_token_ids=[13])
    h.run()
    s = h.all["s"]
    assert s.output_token_ids == [5, 6, 11]
    assert s.finish_reason == "stop" and s.stop_reason == 11
    assert h.all["both"].finish_reason == "stop" and h.all["both"].output_token_ids == [EOS]
    ign = h.all["ign"]
    assert ign.output_token_ids == [EOS, 13] and ign.stop_reason == 13


def test_finish_by_max_model_len():
    h = Harness(max_model_len=10)
    h.add("a", prompt(7), max_tokens=100)
    h.run()
    a = h.all["a"]
    assert a.num_tokens == 10 and a.num_output_tokens == 3 and a.finish_reason == "length"


def test_finished_request_frees_blocks_and_is_removed_once():
    h = Harness(num_blocks=8, block_size=4)
    h.add("a", prompt(9), max_tokens=1)
    h.add("b", prompt(3), max_tokens=5)
    h.step()
    assert h.all["a"].is_finished and h.s.blocks.block_ids("a") == []
    removed = [r for p in (h.step(), h.step()) for r in p.removed_req_ids]
    assert removed == ["a"]
    assert [r.req_id for r in h.s.pop_finished()] == ["a"]


def test_abort_frees_and_lists_removed():
    h = Harness()
    h.add("a", prompt(5), max_tokens=8)
    h.add("b", prompt(5), max_tokens=8)
    h.add("w", prompt(5), max_tokens=8)
    h.s.max_num_seqs = 2
    h.step()
    h.s.abort_request("a")
    h.s.abort_request("w")  # still waiting: no removal needed, the ranks never saw it
    h.check()
    plan = h.step()
    assert plan.removed_req_ids == ["a"]
    assert h.all["a"].finish_reason == "abort" and h.all["w"].finish_reason == "abort"
    assert "w" not in [n.req_id for n in plan.new_reqs]


# ---- stale outputs -----------------------------------------------------------------------

def with_entry(out: SamplerOutput, req_id: str, incarnation: int, token: int) -> SamplerOutput:
    return SamplerOutput(step_id=out.step_id, req_ids=out.req_ids + [req_id],
                         incarnations=out.incarnations + [incarnation],
                         sampled_token_ids=out.sampled_token_ids + [[token]])


def test_output_with_wrong_incarnation_is_dropped():
    h = Harness()
    a = h.add("a", prompt(4), max_tokens=10)
    plan = h.step(feed=False)
    stale = SamplerOutput(step_id=plan.step_id, req_ids=["a"], incarnations=[a.incarnation - 1],
                          sampled_token_ids=[[77]])
    h.feed(plan, stale)
    assert a.output_token_ids == [] and h.s.num_generated_tokens == 0


def test_late_result_of_a_preempted_incarnation_is_dropped():
    """a is preempted while its step is in flight (the driver's audit does this), re-admitted
    as incarnation 2, and only then does the old step's result arrive."""
    h = Harness()
    a = h.add("a", prompt(4), max_tokens=5)
    b = h.add("b", prompt(6), max_tokens=5)
    p1 = h.step(feed=False)
    assert a.incarnation == 1
    h.s.preempt("a")
    h.check()
    assert a.status is RequestStatus.WAITING and h.s.num_preemptions == 1
    p2 = h.step(feed=False)
    assert p2.removed_req_ids == ["a"] and [n.req_id for n in p2.new_reqs] == ["a"]
    assert a.incarnation == 2 and p2.new_reqs[0].incarnation == 2
    late = SamplerOutput(step_id=p1.step_id, req_ids=["a", "b"], incarnations=[1, 1],
                         sampled_token_ids=[[77], [default_token_at(b, 0)]])
    h.feed(p1, late)
    assert a.output_token_ids == []  # dropped by incarnation
    assert b.output_token_ids == [default_token_at(b, 0)]  # the rest of the step counts
    h.feed(p2)
    assert a.output_token_ids == [default_token_at(a, 0)]
    h.run()
    assert a.output_token_ids == [default_token_at(a, k) for k in range(5)]
    assert b.output_token_ids == [default_token_at(b, k) for k in range(5)]


def test_stale_output_while_waiting_and_after_readmission_is_dropped():
    h = Harness(budget=64, num_blocks=4, block_size=4)
    a = h.add("A", prompt(8), max_tokens=3)
    b = h.add("B", prompt(8), max_tokens=4)
    h.step()
    h.step()  # A needs a 3rd block: B (most recent) is preempted
    assert b.status is RequestStatus.WAITING and b.incarnation == 1
    before = list(b.token_ids)
    plan = h.step(feed=False)
    h.feed(plan, with_entry(h.output_for(plan), "B", 1, 55))  # B is waiting: dropped
    assert b.token_ids == before
    while b.status is not RequestStatus.RUNNING:
        h.step()
    assert b.incarnation == 2
    while True:
        plan = h.step(feed=False)
        if plan is None or "B" in [r for r, _ in h.samples[plan.step_id]]:
            break
        h.feed(plan)
    # B's real result (incarnation 2) and a late one of incarnation 1 in the same output.
    h.feed(plan, with_entry(h.output_for(plan), "B", 1, 55))
    h.run()
    assert 55 not in b.output_token_ids
    assert b.output_token_ids == [default_token_at(b, k) for k in range(4)]
    assert a.output_token_ids == [default_token_at(a, k) for k in range(3)]


def test_stale_output_for_finished_or_aborted_request_is_ignored():
    h = Harness()
    a = h.add("a", prompt(4), max_tokens=1)
    b = h.add("b", prompt(4), max_tokens=5)
    h.step()
    assert a.is_finished
    inc = a.incarnation
    plan = h.step(feed=False)
    h.feed(plan, with_entry(h.output_for(plan), "a", inc, 9))
    assert a.output_token_ids == [default_token_at(a, 0)]
    assert [r.req_id for r in h.s.pop_finished()] == ["a"]
    plan = h.step(feed=False)
    h.feed(plan, with_entry(h.output_for(plan), "a", inc, 9))  # no longer known at all
    assert a.output_token_ids == [default_token_at(a, 0)]
    # Aborted while its step is in flight: the step's result for it is dropped.
    plan = h.step(feed=False)
    assert "b" in plan.scheduled_req_ids
    h.s.abort_request("b")
    h.check()
    n = b.num_tokens
    h.feed(plan)
    assert b.num_tokens == n and b.finish_reason == "abort"
    assert not h.s.has_unfinished()


def test_in_flight_request_is_not_rescheduled_until_its_result():
    h = Harness()
    h.add("a", prompt(4), max_tokens=5)
    plan = h.step(feed=False)
    assert h.schedule() is None  # its only request is in flight, waiting for its token
    h.add("b", prompt(3), max_tokens=2)
    p2 = h.step(feed=False)
    assert p2.scheduled_req_ids == ["b"]
    h.feed(plan)
    h.feed(p2)
    p3 = h.step()
    assert p3.scheduled_req_ids == ["a", "b"]


def test_next_prefill_chunk_is_planned_while_the_previous_is_in_flight():
    """The tokens of the next chunk are known, so it need not wait for the previous step."""
    h = Harness(budget=8)
    long_req = h.add("long", prompt(20), max_tokens=2)
    p1 = h.step(feed=False)
    p2 = h.step(feed=False)
    p3 = h.step(feed=False)
    assert [p.num_scheduled_tokens for p in (p1, p2, p3)] == [[8], [8], [4]]
    assert h.schedule() is None  # the last chunk samples: now it waits for the token
    for p in (p1, p2):
        h.feed(p)
        assert long_req.num_output_tokens == 0
    h.feed(p3)
    assert long_req.output_token_ids == [default_token_at(long_req, 0)]
    h.run()
    assert long_req.num_output_tokens == 2


# ---- a request that can never fit --------------------------------------------------------

def _schedule_until_error(h: Harness, max_calls: int = 50) -> RuntimeError:
    for _ in range(max_calls):
        try:
            plan = h.schedule()
        except RuntimeError as e:
            return e
        h.check()
        if plan is not None:
            h._apply_plan(plan)
            h.feed(plan)
    pytest.fail(f"no RuntimeError after {max_calls} schedule() calls: the scheduler loops")


def test_prompt_larger_than_pool_raises():
    h = Harness(budget=64, num_blocks=2, block_size=4)
    h.add("big", prompt(9))
    err = _schedule_until_error(h, max_calls=1)
    assert "big" in str(err) and "KV blocks" in str(err)


def test_growth_past_pool_raises():
    # The prompt fits (2 blocks) but its 9th token needs a 3rd block the pool lacks.
    h = Harness(budget=64, num_blocks=2, block_size=4)
    h.add("grow", prompt(8), max_tokens=5)
    err = _schedule_until_error(h, max_calls=5)
    assert "grow" in str(err) and "KV blocks" in str(err)


def test_growth_past_pool_raises_without_an_empty_plan():
    h = Harness(budget=64, num_blocks=2, block_size=4)
    h.add("grow", prompt(8), max_tokens=5)
    h.step()
    with pytest.raises(RuntimeError, match="KV blocks"):
        h.s.schedule()  # the step a driver would run next


def test_big_request_waits_while_others_run_then_raises():
    h = Harness(budget=64, num_blocks=3, block_size=4)
    h.add("small", prompt(4), max_tokens=2)
    h.add("big", prompt(13))
    err = _schedule_until_error(h, max_calls=10)
    assert "big" in str(err)  # raised as soon as it heads the queue, not after a wait


def test_prompt_larger_than_pool_with_chunked_prefill_raises():
    h = Harness(budget=4, num_blocks=2, block_size=4)
    h.add("big", prompt(9), max_tokens=1)
    err = _schedule_until_error(h, max_calls=20)
    assert "big" in str(err)


# ---- BlockManager on its own -------------------------------------------------------------

def test_block_manager_accounting():
    bm = BlockManager(5, 4)
    assert bm.blocks_needed("a", 0) == 0 and bm.blocks_needed("a", 1) == 1
    assert bm.blocks_needed("a", 8) == 2 and bm.blocks_needed("a", 9) == 3
    got = bm.allocate("a", 6)
    assert len(got) == 2 and bm.block_ids("a") == got
    assert bm.allocate("a", 8) == []  # still fits in its 2 blocks
    assert len(bm.allocate("a", 9)) == 1
    assert not bm.can_allocate("b", 9) and bm.can_allocate("b", 8)
    assert bm.can_allocate("a", 20) and not bm.can_allocate("a", 21)
    bm.allocate("b", 8)
    bm.check()
    assert bm.num_free_blocks == 0
    with pytest.raises(AssertionError):
        bm.allocate("c", 1)
    bm.free("a")
    bm.free("a")  # idempotent
    bm.check()
    assert bm.num_free_blocks == 3 and bm.block_ids("a") == []
    bm._owned["b"].append(bm._free[0])  # double ownership is caught
    with pytest.raises(AssertionError):
        bm.check()

