"""Scheduler with speculative decoding (no Ray): drafts planned after a sample, the optimistic
count corrected on partial acceptance, surplus KV blocks trimmed, acceptance counters, drafts
trimmed to the token budget, preemption, stale results; and the plans followed by two rank
batches (a middle rank and the last rank) audited against the driver's expectations.

SamplerOutputs are built by hand, as the last rank would send them (ray_runtime.messages).
"""
from __future__ import annotations

import numpy as np
import pytest

from ray_runtime.digest import extend_hash
from ray_runtime.messages import SamplerOutput
from ray_runtime.reconcile import audit
from ray_runtime.request import Request, RequestStatus
from ray_runtime.sampling_params import SamplingParams
from ray_runtime.plan_record import PlanRecord
from ray_runtime.scheduler import Scheduler
from stages.input_batch import InputBatch

K = 3
EOS = 2


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class Driver:
    """A Scheduler with num_speculative_tokens=K and the bookkeeping a test needs."""

    def __init__(self, *, budget: int = 64, num_blocks: int = 64, block_size: int = 2,
                 max_model_len: int = 256, max_num_seqs: int = 4) -> None:
        self.s = Scheduler(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                           num_kv_blocks=num_blocks, block_size=block_size,
                           max_model_len=max_model_len, num_speculative_tokens=K)
        self.bs = block_size
        self.arrivals = 0

    def add(self, req_id: str, prompt: list[int], **sp) -> Request:
        sp.setdefault("max_tokens", 50)
        sp.setdefault("temperature", 0.0)
        req = Request(req_id, prompt, SamplingParams(**sp), frozenset({EOS}), self.arrivals)
        self.arrivals += 1
        self.s.add_request(req)
        return req

    def schedule(self) -> PlanRecord:
        rec = self.s.schedule()
        assert rec is not None
        self.s.check()
        return rec

    def feed(self, rec: PlanRecord, entries: list[tuple], *,
             incarnations: list[int] | None = None) -> SamplerOutput:
        """entries: (req_id, sampled tokens, drafts verified, next proposal)."""
        ids = [e[0] for e in entries]
        incs = incarnations or [self.s.requests[r].incarnation for r in ids]
        out = SamplerOutput(step_id=rec.plan.step_id, req_ids=ids, incarnations=incs,
                            sampled_token_ids=[list(e[1]) for e in entries],
                            num_draft_tokens=[e[2] for e in entries],
                            draft_token_ids=[list(e[3]) for e in entries])
        self.s.update_from_output(rec, out)
        self.s.check()
        return out

    def counters(self) -> tuple:
        s = self.s
        return (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens,
                list(s.spec_num_accepted_tokens_per_pos), s.num_rolled_back_blocks)


PROMPT = [10, 11, 12, 13, 14]
T0 = 50  # the token sampled after the prefill
DRAFTS = [61, 62, 63]


def prefilled_with_drafts(**kw) -> tuple[Driver, Request]:
    """A's prefill ran and sampled T0, with the proposal DRAFTS for its next step."""
    d = Driver(**kw)
    a = d.add("A", PROMPT)
    rec = d.schedule()
    assert [n.req_id for n in rec.plan.new_reqs] == ["A"] and rec.plan.num_scheduled_tokens == [5]
    assert rec.plan.prefill_shaped  # 1 of its 5 tokens gets logits
    # KV for the prompt and the K-slot lookahead
    assert d.s.blocks.num_owned("A") == blocks_for(5 + K, d.bs)
    assert rec.num_drafts == {"A": 0} and rec.expected["A"].num_draft_tokens == 0
    d.feed(rec, [("A", [T0], 0, DRAFTS)])
    assert a.draft_token_ids == DRAFTS and a.token_ids == PROMPT + [T0]
    assert d.counters() == (0, 0, 0, [0] * K, 0), "a step without drafts counts no verdict"
    return d, a


# ---- drafts planned after a sample ---------------------------------------------------------

def test_next_step_verifies_the_proposed_drafts():
    d, a = prefilled_with_drafts()
    owned_before = d.s.blocks.num_owned("A")
    rec = d.schedule()
    plan = rec.plan
    assert plan.scheduled_req_ids == ["A"] and plan.num_scheduled_tokens == [1 + K]
    assert not plan.prefill_shaped  # every token of a verifying step gets logits
    assert plan.new_reqs == [] and len(plan.cached_reqs) == 1
    c = plan.cached_reqs[0]
    assert c.draft_token_ids == DRAFTS
    assert c.token_start == len(PROMPT) and c.new_token_ids == [T0]
    assert c.num_computed_tokens == len(PROMPT)
    assert c.block_start == owned_before
    # KV for its 1 + K tokens and the lookahead after them
    assert d.s.blocks.num_owned("A") == blocks_for(len(PROMPT) + 1 + K + K, d.bs)
    assert c.new_block_ids == d.s.blocks.block_ids("A")[owned_before:]
    assert rec.num_drafts == {"A": K} and "A" in rec.sampling
    exp = rec.expected["A"]
    assert exp.incarnation == a.incarnation == 1
    assert exp.num_tokens_known == len(PROMPT) + 1
    assert exp.num_computed_tokens == len(PROMPT)
    assert exp.num_draft_tokens == K
    assert exp.token_hash == extend_hash(0, 0, PROMPT + [T0] + DRAFTS), "hash misses the drafts"
    assert exp.token_hash == extend_hash(a.token_hash, a.num_tokens, DRAFTS)
    # optimistic: every draft counted as computed; the proposal is spent
    assert a.num_computed_tokens == len(PROMPT) + 1 + K
    assert a.draft_token_ids == []
    d.s.blocks.check()


def test_no_drafts_no_spec_step():
    d = Driver()
    a = d.add("A", PROMPT)
    d.feed(d.schedule(), [("A", [T0], 0, [])])
    rec = d.schedule()
    assert rec.plan.num_scheduled_tokens == [1]
    assert rec.plan.cached_reqs[0].draft_token_ids == [] and rec.num_drafts == {"A": 0}
    d.feed(rec, [("A", [T0 + 1], 0, [])])
    assert d.counters() == (0, 0, 0, [0] * K, 0)
    assert a.num_computed_tokens == a.num_tokens - 1


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
def test_partial_acceptance_takes_back_rejected_drafts_and_blocks(accepted):
    d, a = prefilled_with_drafts()
    rec = d.schedule()
    computed_planned = a.num_computed_tokens
    owned_planned = d.s.blocks.num_owned("A")
    free_planned = d.s.blocks.num_free_blocks
    emitted = DRAFTS[:accepted] + [77]
    d.feed(rec, [("A", emitted, K, [81, 82, 83])])
    rejected = K - accepted
    assert a.num_computed_tokens == computed_planned - rejected
    assert a.token_ids == PROMPT + [T0] + emitted
    assert a.num_computed_tokens == a.num_tokens - 1  # only the correction/bonus is new
    per_pos = [1 if p < accepted else 0 for p in range(K)]
    keep = blocks_for(a.num_computed_tokens + K, d.bs)
    freed = owned_planned - keep
    assert d.counters() == (1, K, accepted, per_pos, freed)
    assert d.s.blocks.num_owned("A") == keep
    assert d.s.blocks.num_free_blocks == free_planned + freed
    if accepted <= 1:
        assert freed == 1, "block_size 2: the rejected drafts' last block must be given back"
    d.s.blocks.check()
    # The next plan: the new proposal, the block table rolled back to what A still owns.
    rec2 = d.schedule()
    c = rec2.plan.cached_reqs[0]
    assert c.block_start == keep
    assert c.token_start == len(PROMPT) + 1 and c.new_token_ids == emitted
    assert c.num_computed_tokens == a.num_tokens - 1
    assert c.draft_token_ids == [81, 82, 83]
    assert d.s.blocks.block_ids("A")[:keep] == d.s.blocks.block_ids("A")[:c.block_start]


def test_counters_accumulate_over_steps():
    d, a = prefilled_with_drafts()
    d.feed(d.schedule(), [("A", [61, 70], K, [71, 72, 73])])  # 1 of 3
    d.feed(d.schedule(), [("A", [71, 72, 73, 74], K, [90, 91])])  # 3 of 3 (bonus)
    d.feed(d.schedule(), [("A", [5], 2, [])])  # 0 of 2 (a shorter proposal)
    rec = d.schedule()
    assert rec.plan.num_scheduled_tokens == [1] and rec.num_drafts == {"A": 0}
    d.feed(rec, [("A", [6], 0, [])])
    drafts, draft_tokens, acc, per_pos, _ = d.counters()
    assert (drafts, draft_tokens, acc, per_pos) == (3, 8, 4, [2, 1, 1])
    assert a.output_token_ids == [T0, 61, 70, 71, 72, 73, 74, 5, 6]
    assert a.num_computed_tokens == a.num_tokens - 1
    d.s.blocks.check()


def test_all_accepted_frees_nothing():
    d, a = prefilled_with_drafts()
    rec = d.schedule()
    owned = d.s.blocks.block_ids("A")
    d.feed(rec, [("A", DRAFTS + [77], K, [])])
    assert d.s.blocks.block_ids("A") == owned and d.s.num_rolled_back_blocks == 0
    assert a.num_computed_tokens == len(PROMPT) + 1 + K == a.num_tokens - 1


# ---- budget --------------------------------------------------------------------------------

def test_drafts_trimmed_to_the_token_budget():
    d = Driver(budget=3)
    a = d.add("A", [10, 11, 12])
    d.feed(d.schedule(), [("A", [T0], 0, DRAFTS)])
    rec = d.schedule()
    assert rec.plan.num_scheduled_tokens == [3]
    assert rec.plan.cached_reqs[0].draft_token_ids == DRAFTS[:2]
    assert rec.num_drafts == {"A": 2}
    assert rec.expected["A"].num_draft_tokens == 2
    assert rec.expected["A"].token_hash == extend_hash(0, 0, [10, 11, 12, T0] + DRAFTS[:2])
    assert a.draft_token_ids == [] and a.num_computed_tokens == 4 + 2
    with pytest.raises(RuntimeError, match="accepted 3 of 2"):
        d.feed(rec, [("A", DRAFTS + [77], 2, [])])


def test_drafts_trimmed_to_the_budget_left_by_older_requests():
    d = Driver(budget=5)
    a = d.add("A", [10, 11])
    b = d.add("B", [20, 21])
    rec = d.schedule()
    assert rec.plan.num_scheduled_tokens == [2, 2]
    d.feed(rec, [("A", [30], 0, [31, 32, 33]), ("B", [40], 0, [41, 42, 43])])
    rec = d.schedule()
    assert rec.plan.scheduled_req_ids == ["A", "B"]
    assert rec.plan.num_scheduled_tokens == [4, 1]  # B gets the one token left: no drafts
    assert [c.draft_token_ids for c in rec.plan.cached_reqs] == [[31, 32, 33], []]
    assert rec.num_drafts == {"A": 3, "B": 0}
    assert rec.expected["B"].token_hash == b.token_hash
    assert b.draft_token_ids == []  # spent unused: the next proposal comes with this result
    d.feed(rec, [("A", [31, 32, 9], 3, []), ("B", [44], 0, [45])])
    assert d.counters()[:4] == (1, 3, 2, [1, 1, 0])
    assert a.output_token_ids == [30, 31, 32, 9] and b.output_token_ids == [40, 44]
    rec = d.schedule()
    assert rec.plan.num_scheduled_tokens == [1, 2]
    assert rec.num_drafts == {"A": 0, "B": 1}


def test_no_drafts_while_a_step_is_in_flight():
    """Drafts belong to the step right after the result that proposed them: a one-token
    step planned while another step of the request is in flight carries none."""
    d = Driver(budget=4)
    a = d.add("A", list(range(10, 19)))  # 9 tokens: chunks of 4, 4, 1
    recs = [d.schedule(), d.schedule()]
    a.draft_token_ids = [1, 2, 3]  # a (hypothetical) proposal present while steps fly
    recs.append(d.schedule())
    assert [r.plan.num_scheduled_tokens for r in recs] == [[4], [4], [1]]
    assert recs[2].num_drafts == {"A": 0} and recs[2].expected["A"].num_draft_tokens == 0
    d.feed(recs[0], [])
    d.feed(recs[1], [])
    d.feed(recs[2], [("A", [T0], 0, DRAFTS)])
    rec = d.schedule()
    assert rec.plan.cached_reqs[0].draft_token_ids == DRAFTS
    assert rec.plan.num_scheduled_tokens == [4]


# ---- preemption ----------------------------------------------------------------------------

def test_preemption_clears_drafts_and_readmission_sends_none():
    d, a = prefilled_with_drafts()
    d.s.preempt("A")
    assert a.status is RequestStatus.WAITING and a.draft_token_ids == []
    assert d.s.blocks.num_owned("A") == 0
    rec = d.schedule()
    assert rec.plan.removed_req_ids == ["A"] and len(rec.plan.cached_reqs) == 0
    (new,) = rec.plan.new_reqs
    assert new.req_id == "A" and new.incarnation == 2 == a.incarnation
    assert new.token_ids == PROMPT + [T0] and new.num_computed_tokens == 0
    assert not hasattr(new, "draft_token_ids")
    assert rec.plan.num_scheduled_tokens == [len(PROMPT) + 1]
    assert rec.num_drafts == {"A": 0} and rec.expected["A"].num_draft_tokens == 0
    assert rec.expected["A"].token_hash == a.token_hash
    assert d.s.blocks.num_owned("A") == blocks_for(len(PROMPT) + 1 + K, d.bs)
    d.feed(rec, [("A", [51], 0, [1, 2, 3])])
    assert d.schedule().plan.cached_reqs[0].draft_token_ids == [1, 2, 3]


def test_kv_pressure_preempts_the_younger_request_and_drops_its_drafts():
    d = Driver(num_blocks=9, block_size=2)
    a = d.add("A", [10, 11, 12, 13])
    b = d.add("B", [20, 21, 22, 23])
    rec = d.schedule()  # 4 blocks each (4 tokens + 3 lookahead)
    assert rec.plan.scheduled_req_ids == ["A", "B"] and d.s.blocks.num_free_blocks == 1
    d.feed(rec, [("A", [30], 0, [31, 32, 33]), ("B", [40], 0, [41, 42, 43])])
    rec = d.schedule()  # A's 1 + 3 tokens and lookahead need 6 blocks: B goes
    assert d.s.num_preemptions == 1 and b.status is RequestStatus.WAITING
    assert b.draft_token_ids == [] and b.incarnation == 1
    assert rec.plan.scheduled_req_ids == ["A"] and rec.plan.removed_req_ids == ["B"]
    assert rec.plan.new_reqs == []
    assert rec.plan.cached_reqs[0].draft_token_ids == [31, 32, 33]
    d.feed(rec, [("A", [31, 99], 3, [])])  # rejects 2: a block comes back
    assert d.s.num_rolled_back_blocks == 1 and a.output_token_ids == [30, 31, 99]
    rec = d.schedule()
    (new,) = rec.plan.new_reqs
    assert new.req_id == "B" and new.incarnation == 2 and new.token_ids == [20, 21, 22, 23, 40]
    assert rec.num_drafts["B"] == 0 and rec.expected["B"].num_draft_tokens == 0
    d.s.blocks.check()


# ---- stale and impossible results ------------------------------------------------------------

def test_stale_output_of_an_older_incarnation_changes_nothing():
    d, a = prefilled_with_drafts()
    rec = d.schedule()  # verifies 3 drafts, incarnation 1
    d.s.preempt("A")
    rec2 = d.schedule()  # re-admitted as incarnation 2
    assert a.incarnation == 2
    counters, computed = d.counters(), a.num_computed_tokens
    owned, tokens = d.s.blocks.block_ids("A"), list(a.token_ids)
    dropped = d.s.num_dropped_samples
    d.feed(rec, [("A", [61, 77], K, [5, 6, 7])], incarnations=[1])
    assert d.counters() == counters
    assert a.num_computed_tokens == computed and a.token_ids == tokens
    assert d.s.blocks.block_ids("A") == owned
    assert a.draft_token_ids == [], "a stale proposal was kept"
    assert d.s.num_dropped_samples == dropped + 2
    assert a.num_inflight_steps == 1  # only rec2's step
    d.feed(rec2, [("A", [51], 0, [])])
    assert a.output_token_ids == [T0, 51]


def test_stale_output_of_an_aborted_request_changes_nothing():
    d, a = prefilled_with_drafts()
    rec = d.schedule()
    d.s.abort_request("A")
    counters = d.counters()
    d.feed(rec, [("A", [61, 77], K, [5])], incarnations=[1])
    assert d.counters() == counters and a.output_token_ids == [T0]
    assert d.s.blocks.num_free_blocks == d.s.blocks.num_blocks


@pytest.mark.parametrize("sampled", [[61, 62, 63, 64, 65], []])
def test_accepted_outside_zero_to_drafted_raises(sampled):
    d, _ = prefilled_with_drafts()
    rec = d.schedule()
    with pytest.raises(RuntimeError, match="accepted"):
        d.feed(rec, [("A", sampled, K, [])])


def test_accepted_without_drafts_raises():
    d = Driver()
    d.add("A", PROMPT)
    rec = d.schedule()
    with pytest.raises(RuntimeError, match="accepted 1 of 0"):
        d.feed(rec, [("A", [T0, 51], 0, [])])


# ---- the ranks follow the plans: audited, token for token --------------------------------------

def truth_token(req_id: str, i: int) -> int:
    """The target's greedy token at output index i."""
    return 100 + (sum(map(ord, req_id)) * 7 + i * 13) % 50


def run_with_ranks(*, num_reqs: int, budget: int, num_blocks: int, max_model_len: int,
                   block_size: int = 2, seed: int = 0, prompt_len=(3, 20),
                   max_tokens=(5, 30)) -> tuple[Driver, dict]:
    """The driver's sync loop against a middle rank's and the last rank's InputBatch: every
    plan applied on both, every digest audited against the plan's expectations, the last rank
    verifying its row's drafts (greedy: accept while draft == truth) and proposing the next
    ones (right with probability 0.6 each), the scheduler corrected by its output."""
    rng = np.random.default_rng(seed)
    d = Driver(budget=budget, num_blocks=num_blocks, block_size=block_size,
               max_model_len=max_model_len, max_num_seqs=4)
    reqs = {}
    for i in range(num_reqs):
        n = int(rng.integers(*prompt_len))
        reqs[f"r{i}"] = d.add(f"r{i}", rng.integers(3, 1000, n).tolist(), ignore_eos=True,
                              max_tokens=int(rng.integers(*max_tokens)))
    ranks = [InputBatch(4, max_model_len, block_size) for _ in range(2)]
    mid, last = ranks
    tally = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0] * K, "partial": 0,
             "reuse_with_drafts": 0}
    for step in range(2000):
        if not d.s.has_unfinished():
            break
        rec = d.schedule()
        plan = rec.plan
        drafts_held = bool(mid.num_draft_tokens.any())
        for rank, b in enumerate(ranks):
            b.apply_plan(plan)
            b.check()
            assert audit(rec.expected, b.digests(plan), rank, b is last) == [], f"step {step}"
        # a slot's next tenant admitted while other requests held drafts
        if drafts_held and any(mid.generation[mid.req_id_to_slot[n.req_id]] > 1
                               for n in plan.new_reqs):
            tally["reuse_with_drafts"] += 1
        for b in ranks:
            for r, n in zip(plan.scheduled_req_ids, plan.num_scheduled_tokens):
                b.mark_computed(r, n)
        entries = []
        for r in plan.scheduled_req_ids:
            if r not in rec.sampling:
                continue
            row = last.req_id_to_slot[r]
            drafts = last.drafts(r)
            assert len(drafts) == rec.num_drafts[r]
            out_idx = int(last.num_tokens_known[row] - last.num_prompt_tokens[row])
            acc = 0
            while acc < len(drafts) and drafts[acc] == truth_token(r, out_idx + acc):
                acc += 1
            emitted = drafts[:acc] + [truth_token(r, out_idx + acc)]
            last.append_tokens(r, emitted)
            last.resolve_drafts(r, acc)
            known = int(last.num_tokens_known[row])
            nxt = out_idx + len(emitted)
            cap = max(0, min(K, reqs[r].sampling.max_tokens - nxt - 1, max_model_len - 1 - known))
            proposal = [truth_token(r, nxt + j) if rng.random() < 0.6 else 999
                        for j in range(cap)]
            last.set_drafts(r, proposal)
            entries.append((r, emitted, len(drafts), proposal))
            if drafts:
                tally["drafts"] += 1
                tally["draft_tokens"] += len(drafts)
                tally["accepted"] += acc
                tally["partial"] += 0 < acc < len(drafts)
                for p in range(acc):
                    tally["per_pos"][p] += 1
        for b in ranks:
            b.check()
        d.feed(rec, entries)
    else:
        pytest.fail("the scheduler did not finish")
    for r, req in reqs.items():
        want = [truth_token(r, i) for i in range(req.num_output_tokens)]
        assert req.output_token_ids == want, f"{r}: spec decoding changed the greedy output"
        cap = min(req.sampling.max_tokens, max_model_len - req.num_prompt_tokens)
        assert req.num_output_tokens == cap and req.finish_reason == "length"
    s = d.s
    assert (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens,
            s.spec_num_accepted_tokens_per_pos) == \
        (tally["drafts"], tally["draft_tokens"], tally["accepted"], tally["per_pos"])
    assert s.blocks.num_free_blocks == num_blocks
    s.blocks.check()
    return d, tally


def test_ranks_follow_spec_plans_roomy():
    d, tally = run_with_ranks(num_reqs=6, budget=64, num_blocks=512, max_model_len=256)
    assert tally["drafts"] > 10 and tally["partial"] > 0
    assert d.s.num_rolled_back_blocks > 0
    assert tally["reuse_with_drafts"] > 0, "no slot was reused while drafts were held"


@pytest.mark.parametrize("seed", [1, 2])
def test_ranks_follow_spec_plans_small_budget_and_pool(seed):
    d, tally = run_with_ranks(num_reqs=8, budget=6, num_blocks=30, max_model_len=256,
                              seed=seed)
    assert d.s.num_preemptions > 0 and tally["drafts"] > 10
    assert d.s.num_rolled_back_blocks > 0


def test_ranks_follow_spec_plans_near_max_model_len():
    """Near max_model_len the driver rolls a row's block table back (block_start <
    num_blocks) and appends: a rollback that fits must not be refused as an overflow."""
    # max_model_len 20, block_size 2: a row's table holds 10 blocks, the lookahead fills it
    run_with_ranks(num_reqs=3, budget=64, num_blocks=64, max_model_len=20,
                   prompt_len=(8, 12), max_tokens=(30, 31))
