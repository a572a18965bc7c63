"""InputBatch with speculative drafts: where drafts sit, what clears them,
how the driver's count settles the unresolved ones, slot reuse, and block-table rollback.

No Ray, no torch. Slots are stable (a request never changes slot), so the drafts and the
unresolved count stay with their request while neighbours leave and new tenants arrive.
"""
from __future__ import annotations

import pytest

from ray_runtime.digest import extend_hash
from ray_runtime.messages import CachedRequest, CachedRequestData, NewRequestData, StepPlan
from ray_runtime.sampling_params import SamplingParams
from stages.input_batch import POISON, InputBatch

MAX_SEQS, MAX_LEN, BS = 4, 32, 4
PROMPT_X = [11, 12, 13, 14]
PROMPT_A = [100, 101, 102, 103, 104, 105]
SAMPLED_A = 200  # the token the last rank sampled after A's prefill
DRAFTS_A = [7, 8, 9]


def new_req(req_id: str, tokens: list[int], blocks: list[int], *, incarnation: int = 1,
            num_prompt: int | None = None, computed: int = 0) -> NewRequestData:
    return NewRequestData(req_id=req_id, incarnation=incarnation, token_ids=list(tokens),
                          num_prompt_tokens=len(tokens) if num_prompt is None else num_prompt,
                          num_computed_tokens=computed, block_ids=list(blocks),
                          sampling=SamplingParams(temperature=0.0))


def delta(req_id: str, start: int, tokens: list[int], computed: int, *, blocks=(),
          drafts=(), block_start=None) -> CachedRequest:
    return CachedRequest(req_id=req_id, token_start=start, new_token_ids=list(tokens),
                             new_block_ids=list(blocks), num_computed_tokens=computed,
                             block_start=block_start, draft_token_ids=list(drafts))


def plan(step: int, *, removed=(), new=(), cached=(), scheduled=(), num=()) -> StepPlan:
    return StepPlan(step_id=step, removed_req_ids=list(removed), new_reqs=list(new),
                    cached_reqs=CachedRequestData.of(cached), scheduled_req_ids=list(scheduled),
                    num_scheduled_tokens=list(num))


def row_of(b: InputBatch, req_id: str) -> int:
    return b.req_id_to_slot[req_id]


def a_with_drafts(batch_cls=InputBatch) -> tuple[InputBatch, StepPlan]:
    """A non-last rank: X (row 0) and A (row 1) prefilled; then a plan sends A its sampled
    token and three drafts, and the step runs all 1 + 3 of them (mark_computed). Returns
    the batch and that plan. A then has known 7, computed 7, drafts [7, 8, 9] unresolved."""
    b = batch_cls(MAX_SEQS, MAX_LEN, BS)
    p0 = plan(0, new=[new_req("X", PROMPT_X, [1]), new_req("A", PROMPT_A, [2, 3])],
              scheduled=["X", "A"], num=[4, 6])
    b.apply_plan(p0)
    b.mark_computed("X", 4)
    b.mark_computed("A", 6)
    assert row_of(b, "X") == 0 and row_of(b, "A") == 1
    p1 = plan(1, cached=[delta("A", 6, [SAMPLED_A], 6, blocks=[4, 5], drafts=DRAFTS_A)],
              scheduled=["A"], num=[4])
    b.apply_plan(p1)
    b.check()
    return b, p1


# ---- where drafts sit ------------------------------------------------------------------------

def test_set_drafts_places_drafts_after_the_known_prefix():
    b = InputBatch(MAX_SEQS, MAX_LEN, BS)
    b.add(new_req("A", PROMPT_A, [1, 2]))
    b.set_drafts("A", DRAFTS_A)
    row = row_of(b, "A")
    n = len(PROMPT_A)
    assert b.token_ids[row, :n].tolist() == PROMPT_A
    assert b.token_ids[row, n:n + 3].tolist() == DRAFTS_A
    assert (b.token_ids[row, n + 3:] == POISON).all()
    assert b.num_tokens_known[row] == n, "drafts are not part of the known prefix"
    assert b.num_draft_tokens[row] == 3 and b.drafts("A") == DRAFTS_A
    assert b.last_sampled_token[row] == PROMPT_A[-1]
    b.check()
    # fewer drafts replace more: the old tail goes back to POISON, no conflict (none overlap)
    b.set_drafts("A", [7])
    assert b.drafts("A") == [7] and (b.token_ids[row, n + 1:] == POISON).all()
    assert b.num_conflicts[row] == 0
    b.check()
    b.set_drafts("A", [])
    assert b.drafts("A") == [] and (b.token_ids[row, n:] == POISON).all()
    b.check()


def test_set_drafts_counts_a_different_overlapping_draft_as_conflict():
    """The last rank proposed drafts itself; the driver sends the same ones (maybe trimmed)."""
    b = InputBatch(MAX_SEQS, MAX_LEN, BS)
    b.add(new_req("A", PROMPT_A, [1, 2]))
    b.set_drafts("A", DRAFTS_A)
    b.set_drafts("A", DRAFTS_A[:2])  # trimmed to the token budget: agrees
    assert b.num_conflicts[row_of(b, "A")] == 0
    b.set_drafts("A", [7, 99])
    assert b.num_conflicts[row_of(b, "A")] == 1


def test_set_drafts_past_max_model_len_is_refused():
    b = InputBatch(MAX_SEQS, 8, BS)
    b.add(new_req("A", PROMPT_A, [1, 2]))
    with pytest.raises(ValueError, match="max_model_len"):
        b.set_drafts("A", DRAFTS_A)
    assert b.num_draft_tokens[row_of(b, "A")] == 0
    b.check()


def test_digest_hash_covers_the_drafts():
    b, p1 = a_with_drafts()
    row = row_of(b, "A")
    (d,) = b.digests(p1)
    known = PROMPT_A + [SAMPLED_A]
    assert d.req_id == "A" and d.num_draft_tokens == 3
    assert d.hash_length == len(known) == d.num_tokens_known
    # What the driver expects (scheduler.py): its own hash, extended by the drafts it sent.
    assert d.token_hash == extend_hash(extend_hash(0, 0, known), len(known), DRAFTS_A)
    assert d.token_hash != extend_hash(0, 0, known), "the drafts are not hashed"
    assert d.num_conflicts == 0
    # One changed draft cell changes the hash.
    b.token_ids[row, len(known) + 1] = 99
    (d2,) = b.digests(p1)
    assert d2.token_hash != d.token_hash
    assert d2.token_hash == extend_hash(0, 0, known + [7, 99, 9])
    # A draft count the driver did not send is reported.
    b.token_ids[row, len(known) + 1] = 8
    b.set_drafts("A", DRAFTS_A[:2])
    (d3,) = b.digests(p1)
    assert d3.num_draft_tokens == 2 and d3.token_hash != d.token_hash


# ---- what clears them ------------------------------------------------------------------------

def test_write_tokens_extending_the_prefix_clears_drafts():
    b, _ = a_with_drafts()
    row = row_of(b, "A")
    known = len(PROMPT_A) + 1
    # Overwriting inside the known prefix (the driver re-sends what the last rank appended)
    # leaves the drafts alone.
    b.write_tokens("A", known - 1, [SAMPLED_A])
    assert b.drafts("A") == DRAFTS_A and b.num_conflicts[row] == 0
    # One accepted draft and a correction: the prefix grows by 2 over the 3 draft cells.
    b.write_tokens("A", known, [7, 55])
    assert b.num_tokens_known[row] == known + 2
    assert b.num_draft_tokens[row] == 0 and b.drafts("A") == []
    assert b.token_ids[row, :known + 2].tolist() == PROMPT_A + [SAMPLED_A, 7, 55]
    assert (b.token_ids[row, known + 2:] == POISON).all(), "the rejected draft survived"
    assert b.last_sampled_token[row] == 55
    assert b.num_conflicts[row] == 0
    b.check()


def test_append_tokens_clears_drafts_even_when_one_token_replaces_three():
    b, _ = a_with_drafts()
    row = row_of(b, "A")
    known = len(PROMPT_A) + 1
    b.append_tokens("A", [42])  # every draft rejected: one correction token
    assert b.num_draft_tokens[row] == 0
    assert b.token_ids[row, known].item() == 42
    assert (b.token_ids[row, known + 1:] == POISON).all()
    b.check()


def test_update_sends_new_drafts_after_the_new_tokens():
    b, _ = a_with_drafts()
    b.mark_computed("A", 4)
    row = row_of(b, "A")
    known = len(PROMPT_A) + 1
    b.apply_plan(plan(2, cached=[delta("A", known, [7, 8, 60], known + 2, drafts=[61, 62])],
                      scheduled=["A"], num=[3]))
    assert b.num_tokens_known[row] == known + 3
    assert b.drafts("A") == [61, 62]
    assert (b.token_ids[row, known + 5:] == POISON).all()
    assert b.num_conflicts[row] == 0
    b.check()


# ---- mark_computed / resolve_drafts ------------------------------------------------------------

def test_mark_computed_counts_only_certain_tokens():
    b, _ = a_with_drafts()
    row = row_of(b, "A")
    b.mark_computed("A", 4)  # its last known token and 3 drafts
    assert b.num_computed_tokens[row] == len(PROMPT_A) + 1
    assert b.num_unresolved_drafts[row] == 3
    b.check()


@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_resolve_drafts_on_the_last_rank(accepted):
    b, _ = a_with_drafts()
    row = row_of(b, "A")
    b.mark_computed("A", 4)
    emitted = DRAFTS_A[:accepted] + [77]
    b.append_tokens("A", emitted)
    b.resolve_drafts("A", accepted)
    assert b.num_computed_tokens[row] == len(PROMPT_A) + 1 + accepted
    assert b.num_unresolved_drafts[row] == 0
    # The driver's next count equals the rank's: no conflict.
    computed = len(PROMPT_A) + 1 + accepted
    b.update(delta("A", len(PROMPT_A) + 1, emitted, computed))
    assert b.num_conflicts[row] == 0
    b.check()


def test_resolve_more_than_unresolved_is_refused():
    b, _ = a_with_drafts()
    b.mark_computed("A", 4)
    with pytest.raises(AssertionError):
        b.resolve_drafts("A", 4)


# ---- a neighbour leaves and a new request takes its slot: A's drafts and counts stay (inv. 2) --

def neighbour_scenario(batch_cls, accepted: int, extra: int = 0) -> InputBatch:
    """A non-last rank. A (slot 1) ran its 1 + 3 drafts; X (slot 0) finishes and a new
    request Y is admitted into X's slot while A's drafts are unresolved; the plan then tells
    A the driver's count, which took in `accepted` drafts (plus `extra`: a count the rank
    cannot explain). Returns the batch."""
    b, _ = a_with_drafts(batch_cls)
    b.mark_computed("X", 0)
    b.mark_computed("A", 4)
    b.num_draft_computed[row_of(b, "A")] = 5  # as the draft model would leave it
    own = len(PROMPT_A) + 1
    assert b.num_unresolved_drafts[row_of(b, "A")] == 3

    b.remove("X")
    assert b.add(new_req("Y", [31, 32], [8])) == 0, "Y did not take X's slot"
    row = row_of(b, "A")
    assert row == 1, "A moved"
    assert b.drafts("A") == DRAFTS_A
    assert b.num_draft_tokens[row] == 3
    assert b.token_ids[row, :own].tolist() == PROMPT_A + [SAMPLED_A]
    assert b.num_computed_tokens[row] == own
    assert b.num_draft_computed[row] == 5
    b.check()

    emitted = DRAFTS_A[:accepted] + [300]
    computed = own + accepted + extra
    # The driver knows only what it commits; blocks for the count in the conflict case.
    b.update(delta("A", own, emitted, computed, blocks=[6, 7]))
    return b


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
def test_neighbour_churn_keeps_drafts_and_unresolved_count(accepted):
    b = neighbour_scenario(InputBatch, accepted)
    row = row_of(b, "A")
    assert b.num_conflicts[row] == 0, "an accepted-draft count read as a conflict after churn"
    assert b.num_computed_tokens[row] == len(PROMPT_A) + 1 + accepted
    assert b.num_unresolved_drafts[row] == 0
    assert b.num_draft_tokens[row] == 0  # the prefix grew over them
    b.check()
    # Y, in X's old slot, starts clean: none of X's or A's state leaked into it
    y = row_of(b, "Y")
    assert b.num_unresolved_drafts[y] == 0 and b.num_draft_tokens[y] == 0
    assert b.num_draft_computed[y] == 0 and b.drafts("Y") == []


def test_count_past_the_unresolved_drafts_is_a_conflict():
    b = neighbour_scenario(InputBatch, accepted=3, extra=1)
    assert b.num_conflicts[row_of(b, "A")] == 1


def test_count_below_the_own_is_a_conflict():
    b, _ = a_with_drafts()
    b.mark_computed("A", 4)
    own = len(PROMPT_A) + 1
    b.update(delta("A", own, [7, 300], own - 1))
    assert b.num_conflicts[row_of(b, "A")] == 1


def test_count_without_unresolved_drafts_must_match_exactly():
    """A plain step (no drafts): the driver's count may not run ahead of the rank's."""
    b = InputBatch(MAX_SEQS, MAX_LEN, BS)
    b.add(new_req("A", PROMPT_A, [1, 2]))
    b.mark_computed("A", 6)
    b.update(delta("A", 6, [50], 7))
    assert b.num_conflicts[row_of(b, "A")] == 1


# ---- slot reuse (docs/invariants.md, 3) ------------------------------------------------------------------

def _resumed_b() -> NewRequestData:
    # arrives already prefilled (preempted and restored / disaggregated)
    return new_req("B", [21, 22, 23], [9], incarnation=4, num_prompt=2, computed=2)


def _assert_fresh_spec_fields(b: InputBatch, row: int) -> None:
    assert b.num_draft_tokens[row] == 0
    assert b.num_unresolved_drafts[row] == 0
    assert b.num_draft_computed[row] == 0
    assert b.drafts("B") == []
    assert (b.token_ids[row, 3:] == POISON).all()
    b.check()


def test_add_into_a_reused_row_resets_spec_fields():
    b, _ = a_with_drafts()
    b.mark_computed("A", 4)
    row = row_of(b, "A")
    b.num_draft_computed[row] = 5
    b.apply_plan(plan(2, removed=["A"], new=[_resumed_b()], scheduled=["B"], num=[1]))
    assert row_of(b, "B") == row
    _assert_fresh_spec_fields(b, row)


def test_add_resets_spec_fields_even_in_a_dirty_hole():
    """add() itself initializes the fields: a hole whose clear missed them (as a row-bound
    field would be missed) still gives the new tenant zeros."""
    b, _ = a_with_drafts()
    b.mark_computed("A", 4)
    row = row_of(b, "A")
    b.remove("A")
    b.num_draft_tokens[row] = 3
    b.num_unresolved_drafts[row] = 3
    b.num_draft_computed[row] = 5
    b.token_ids[row, 3:6] = DRAFTS_A
    assert b.add(_resumed_b()) == row
    _assert_fresh_spec_fields(b, row)
    # the stale unresolved count cannot excuse a driver count past the new tenant's own
    b.update(delta("B", 3, [], 3, blocks=[]))
    assert b.num_conflicts[row] == 1


# ---- block table rollback --------------------------------------------------------------------

def test_block_start_rolls_back_the_block_table():
    b = InputBatch(MAX_SEQS, MAX_LEN, BS)
    b.add(new_req("A", PROMPT_A, [1, 2, 3, 4]))
    b.mark_computed("A", 6)
    row = row_of(b, "A")
    b.update(delta("A", 6, [50], 6, blocks=[9], block_start=2))
    assert b.num_blocks[row] == 3
    assert b.block_table[row, :3].tolist() == [1, 2, 9]
    assert (b.block_table[row, 3:] == 0).all(), "rolled-back block ids survived"
    assert b.num_conflicts[row] == 0
    b.check()
    # block_start == num_blocks is a plain append; no new blocks with a rollback just trims
    b.update(delta("A", 7, [], 6, blocks=[10], block_start=3))
    assert b.block_table[row, :4].tolist() == [1, 2, 9, 10]
    b.update(delta("A", 7, [], 6, blocks=[], block_start=2))
    assert b.num_blocks[row] == 2 and (b.block_table[row, 2:] == 0).all()
    b.check()


def test_block_start_none_appends():
    b = InputBatch(MAX_SEQS, MAX_LEN, BS)
    b.add(new_req("A", PROMPT_A, [1, 2]))
    b.update(delta("A", 6, [], 0, blocks=[3]))
    assert b.block_table[row_of(b, "A"), :3].tolist() == [1, 2, 3]


def test_block_start_past_the_table_is_refused():
    b = InputBatch(MAX_SEQS, MAX_LEN, BS)
    b.add(new_req("A", PROMPT_A, [1, 2]))
    with pytest.raises(AssertionError, match="blocks start at 3"):
        b.update(delta("A", 6, [], 0, blocks=[5], block_start=3))


def test_block_rollback_beside_a_removal():
    b, _ = a_with_drafts()  # A: blocks [2, 3, 4, 5]
    b.mark_computed("X", 0)
    b.mark_computed("A", 4)
    b.apply_plan(plan(2, removed=["X"],
                      cached=[delta("A", 7, [7, 300], 8, blocks=[11], block_start=3)],
                      scheduled=["A"], num=[1]))
    row = row_of(b, "A")
    assert row == 1, "A moved when X left"
    assert b.block_table[row, :4].tolist() == [2, 3, 4, 11]
    assert (b.block_table[row, 4:] == 0).all()
    b.check()


def test_rollback_that_fits_is_not_an_overflow():
    b = InputBatch(2, 16, 4)  # 4 blocks per row
    b.add(new_req("A", list(range(10, 18)), [1, 2, 3, 4]))  # a full table (lookahead)
    b.mark_computed("A", 8)
    b.update(delta("A", 8, [5], 8, blocks=[9], block_start=3))  # 3 + 1 blocks fit
    row = row_of(b, "A")
    assert b.block_table[row].tolist() == [1, 2, 3, 9]
