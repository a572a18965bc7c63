"""InputBatch against a plain model, slot reuse, and the invariant-1 scenario with a planted bug.

No Ray, no torch: InputBatch is pure numpy. Capacities are small on purpose (6 slots, 64
tokens, blocks of 4) so that free slots, full batches and slot reuse happen in almost every
example. Slots are stable: a request never leaves the slot it was admitted into.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ray_runtime.messages import CachedRequest, CachedRequestData, NewRequestData, StepPlan
from ray_runtime.sampling_params import SamplingParams
from stages.input_batch import POISON, InputBatch

MAX_SEQS, MAX_LEN, BS = 6, 64, 4
MAX_BLOCKS = -(-MAX_LEN // BS)
REQ_POOL = [f"r{i}" for i in range(10)]  # ids are reused: a removed request may come back


# ---- helpers shared by every test ----------------------------------------------------------
@dataclass
class ReqModel:
    tokens: list[int]
    num_prompt: int
    num_computed: int
    blocks: list[int]
    sampling: SamplingParams
    incarnation: int
    num_conflicts: int = 0  # driver values that disagreed with the row (update / write_tokens)

    def write(self, start: int, tokens: list[int]) -> None:
        """The driver's tokens [start, start + len): overwrite what is held, extend past it."""
        held = self.tokens[start:start + len(tokens)]
        self.num_conflicts += sum(a != b for a, b in zip(held, tokens))
        self.tokens[start:start + len(tokens)] = tokens


def batch_state(b: InputBatch):
    """Everything in the batch, copied, for 'a rejected call changed nothing' checks."""
    arrays = {name: v.copy() for name, v in vars(b).items() if isinstance(v, np.ndarray)}
    return arrays, list(b.req_ids), dict(b.req_id_to_slot), [id(s) for s in b.sampling]


def assert_same_state(before, after) -> None:
    arrays_b, ids_b, map_b, samp_b = before
    arrays_a, ids_a, map_a, samp_a = after
    for name in arrays_b:
        np.testing.assert_array_equal(arrays_a[name], arrays_b[name], err_msg=name)
    assert ids_a == ids_b and map_a == map_b and samp_a == samp_b


def assert_hole_clear(b: InputBatch, row: int) -> None:
    assert b.req_ids[row] is None
    assert (b.token_ids[row] == POISON).all(), f"hole {row}: stale tokens"
    for name in InputBatch._ROW_SCALARS:
        expected = POISON if name == "last_sampled_token" else 0
        assert getattr(b, name)[row] == expected, f"hole {row}: {name}={getattr(b, name)[row]}"
    assert (b.block_table[row] == 0).all(), f"hole {row}: stale block ids"
    assert b.sampling[row] is None


def assert_row_matches(b: InputBatch, req_id: str, m: ReqModel) -> None:
    row = b.req_id_to_slot[req_id]
    where = f"{req_id!r} (row {row})"
    known = len(m.tokens)
    assert b.req_ids[row] == req_id
    assert b.num_tokens_known[row] == known, f"{where}: known {b.num_tokens_known[row]} != {known}"
    assert b.token_ids[row, :known].tolist() == m.tokens, f"{where}: known prefix differs"
    assert (b.token_ids[row, known:] == POISON).all(), f"{where}: stale tokens past the prefix"
    assert b.num_prompt_tokens[row] == m.num_prompt
    assert b.num_computed_tokens[row] == m.num_computed
    assert b.num_blocks[row] == len(m.blocks)
    assert b.block_table[row, :len(m.blocks)].tolist() == m.blocks, f"{where}: block table"
    assert (b.block_table[row, len(m.blocks):] == 0).all(), f"{where}: stale block ids"
    assert b.sampling[row] is m.sampling, f"{where}: another request's SamplingParams"
    assert b.incarnation[row] == m.incarnation
    assert b.last_sampled_token[row] == m.tokens[-1], f"{where}: last_sampled_token"
    assert b.num_conflicts[row] == m.num_conflicts, f"{where}: num_conflicts"


def assert_matches_model(b: InputBatch, model: dict[str, ReqModel]) -> None:
    assert set(b.req_id_to_slot) == set(model)
    assert b.num_reqs == len(model)
    for req_id, m in model.items():
        assert_row_matches(b, req_id, m)
    live_rows = set(b.req_id_to_slot.values())
    assert len(live_rows) == len(model)
    for row in range(b.max_num_seqs):
        if row not in live_rows:
            assert_hole_clear(b, row)


sampling_params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 32),
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    top_k=st.sampled_from([0, -1, 5]),
    seed=st.one_of(st.none(), st.integers(0, 2**31)),
)


def _ids(data, n: int, low: int, high: int, label: str) -> list[int]:
    """n ids from a drawn seed: drawing each id through hypothesis is slow and buys nothing."""
    if n == 0:
        return []
    seed = data.draw(st.integers(0, 2**32 - 1), label=label)
    return np.random.default_rng(seed).integers(low, high, n).tolist()


def _room(m: ReqModel) -> int:
    return min(len(m.tokens), len(m.blocks) * BS) - m.num_computed


# ---- 1. the stateful model test ------------------------------------------------------------
class InputBatchMachine(RuleBasedStateMachine):
    @initialize(array_path=st.booleans())
    def setup(self, array_path):
        self.batch = InputBatch(MAX_SEQS, MAX_LEN, BS)
        if array_path:  # update_many's array path even for this small batch's plans
            self.batch.array_path_min = 1
        self.model: dict[str, ReqModel] = {}
        self.rows: dict[str, int] = {}  # where the model expects each request
        self.prev_tenants = list(self.batch.req_ids)  # for the generation check
        self.prev_generation = self.batch.generation.copy()

    # -- strategies that depend on the state
    def _live(self, data, pred=lambda m: True) -> str:
        ids = sorted(r for r, m in self.model.items() if pred(m))
        assert ids, "a precondition should have ruled this out"
        return data.draw(st.sampled_from(ids), label="req_id")

    def _any_live(self, pred=lambda m: True) -> bool:
        return any(pred(m) for m in self.model.values())

    def _new_request(self, data, req_id: str, resumed: Optional[bool] = None) -> NewRequestData:
        """resumed: a preempted/disaggregated request, arriving with outputs and with KV
        (num_computed_tokens > 0); fresh: prompt only, nothing computed; None: either."""
        if resumed is None:
            resumed = data.draw(st.booleans(), label="resumed")
        n = data.draw(st.integers(2 if resumed else 1, MAX_LEN), label="num_tokens")
        tokens = _ids(data, n, 0, 50_000, "tokens")
        if resumed:
            num_prompt = data.draw(st.integers(1, n - 1), label="num_prompt")
            computed = data.draw(st.integers(1, n), label="num_computed")
        else:
            num_prompt, computed = n, 0
        nblocks = data.draw(st.integers(-(-computed // BS), MAX_BLOCKS), label="num_blocks")
        blocks = _ids(data, nblocks, 1, 10_000, "blocks")
        return NewRequestData(req_id=req_id, incarnation=data.draw(st.integers(1, 100)),
                              token_ids=tokens, num_prompt_tokens=num_prompt,
                              num_computed_tokens=computed, block_ids=blocks,
                              sampling=data.draw(sampling_params))

    def _admit(self, new: NewRequestData, row: int, generation_before: np.ndarray) -> None:
        assert generation_before[row] + 1 == self.batch.generation[row], "generation not bumped"
        self.model[new.req_id] = ReqModel(list(new.token_ids), new.num_prompt_tokens,
                                          new.num_computed_tokens, list(new.block_ids),
                                          new.sampling, new.incarnation)
        self.rows[new.req_id] = row

    # -- rules
    @precondition(lambda self: len(self.model) < MAX_SEQS)
    @rule(data=st.data(), resumed=st.booleans())
    def add(self, data, resumed):
        req_id = data.draw(st.sampled_from([r for r in REQ_POOL if r not in self.model]))
        new = self._new_request(data, req_id, resumed)
        holes = {r for r in range(MAX_SEQS) if self.batch.req_ids[r] is None}
        gen = self.batch.generation.copy()
        row = self.batch.add(new)
        assert row in holes, f"add put {req_id!r} in live row {row}"
        others = [r for r in range(MAX_SEQS) if r != row]
        assert (self.batch.generation[others] == gen[others]).all()
        self._admit(new, row, gen)

    @precondition(lambda self: len(self.model) < MAX_SEQS)
    @rule(data=st.data(), resumed=st.booleans())
    def add_more(self, data, resumed):
        """Twice the weight for admissions, so that full batches are frequent."""
        self.add(data, resumed)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), which=st.sampled_from(["add", "append", "update"]))
    def rejected_call(self, data, which):
        """A call the batch must refuse, raising before it changes anything."""
        {"add": self._add_rejected, "append": self._append_tokens_overflow,
         "update": self._update_gap_rejected}[which](data)

    def _add_rejected(self, data):
        """A duplicate id, or a full batch: an exception, and nothing changed."""
        if len(self.model) < MAX_SEQS:
            req_id = self._live(data)
            exc = ValueError
        else:
            req_id = data.draw(st.sampled_from([r for r in REQ_POOL if r not in self.model]))
            exc = RuntimeError
        new = self._new_request(data, req_id)
        before = batch_state(self.batch)
        with pytest.raises(exc):
            self.batch.add(new)
        assert_same_state(before, batch_state(self.batch))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data):
        req_id = self._live(data)
        self.batch.remove(req_id)
        del self.model[req_id]
        del self.rows[req_id]

    @rule(data=st.data())
    def remove_unknown(self, data):
        """Removing a request the rank does not hold (aborted before it reached the rank):
        a counted no-op, never a crash."""
        absent = [r for r in REQ_POOL if r not in self.model]
        if not absent:
            return
        before = self.batch.num_unknown_removals
        assert self.batch.remove(data.draw(st.sampled_from(absent))) is False
        assert self.batch.num_unknown_removals == before + 1

    @precondition(lambda self: self._any_live(lambda m: len(m.tokens) < MAX_LEN))
    @rule(data=st.data())
    def append_tokens(self, data):
        req_id = self._live(data, lambda m: len(m.tokens) < MAX_LEN)
        m = self.model[req_id]
        k = data.draw(st.integers(1, MAX_LEN - len(m.tokens)), label="k")
        new_ids = _ids(data, k, 0, 50_000, "new_ids")
        self.batch.append_tokens(req_id, new_ids)
        m.tokens.extend(new_ids)

    def _append_tokens_overflow(self, data):
        req_id = self._live(data)
        k = MAX_LEN - len(self.model[req_id].tokens) + data.draw(st.integers(1, 3))
        before = batch_state(self.batch)
        with pytest.raises(ValueError):
            self.batch.append_tokens(req_id, [7] * k)
        assert_same_state(before, batch_state(self.batch))

    @precondition(lambda self: self._any_live(lambda m: _room(m) > 0))
    @rule(data=st.data())
    def mark_computed(self, data):
        # never past the known count, nor past the KV blocks the request holds
        req_id = self._live(data, lambda m: _room(m) > 0)
        m = self.model[req_id]
        n = data.draw(st.integers(1, _room(m)), label="n")
        self.batch.mark_computed(req_id, n)
        m.num_computed += n

    def _delta(self, data, req_id: str, overlap: bool = False) -> CachedRequest:
        """The driver's delta. Plain: tokens appended at the end of the known prefix.
        overlap: token_start up to 3 positions back (the last rank appended its own samples
        first), with the overlapped part either agreeing with the row or not."""
        m = self.model[req_id]
        known = len(m.tokens)
        start = data.draw(st.integers(max(0, known - 3), known), label="token_start") \
            if overlap else known
        if data.draw(st.booleans(), label="agree"):
            over = m.tokens[start:known]
        else:
            over = _ids(data, known - start, 0, 50_000, "over")
        k = data.draw(st.integers(0, min(3, MAX_LEN - known)), label="k")
        nb = data.draw(st.integers(0, min(3, MAX_BLOCKS - len(m.blocks))), label="nb")
        return CachedRequest(
            req_id=req_id, token_start=start,
            new_token_ids=over + _ids(data, k, 0, 50_000, "new_token_ids"),
            new_block_ids=_ids(data, nb, 1, 10_000, "new_block_ids"),
            num_computed_tokens=m.num_computed,
            # the scheduler names where appended blocks start; None means the same
            block_start=data.draw(st.sampled_from([None, len(m.blocks)]), label="block_start"))

    def _apply_delta_to_model(self, delta: CachedRequest) -> None:
        m = self.model[delta.req_id]
        if delta.num_computed_tokens != m.num_computed:  # the driver's count is canonical
            m.num_conflicts += 1
            m.num_computed = delta.num_computed_tokens
        m.write(delta.token_start, list(delta.new_token_ids))
        m.blocks.extend(delta.new_block_ids)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), overlap=st.booleans())
    def update(self, data, overlap):
        delta = self._delta(data, self._live(data), overlap)
        self.batch.update(delta)
        self._apply_delta_to_model(delta)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def update_other_computed(self, data):
        """The driver's num_computed_tokens disagrees with the rank's (kept within the tokens
        and blocks the row will hold): the rank takes the driver's and counts a conflict."""
        req_id = self._live(data)
        m = self.model[req_id]
        delta = self._delta(data, req_id, overlap=True)
        known_after = max(len(m.tokens), delta.token_start + len(delta.new_token_ids))
        limit = min(known_after, (len(m.blocks) + len(delta.new_block_ids)) * BS)
        other = data.draw(st.integers(0, limit), label="driver_computed")
        delta = CachedRequest(req_id=req_id, token_start=delta.token_start,
                                  new_token_ids=delta.new_token_ids,
                                  new_block_ids=delta.new_block_ids, num_computed_tokens=other)
        self.batch.update(delta)
        self._apply_delta_to_model(delta)

    def _update_gap_rejected(self, data):
        """Driver tokens starting past the row's known prefix: refused, nothing changed."""
        req_id = self._live(data)
        m = self.model[req_id]
        start = len(m.tokens) + data.draw(st.integers(1, 3))
        delta = CachedRequest(req_id=req_id, token_start=start, new_token_ids=[5],
                                  new_block_ids=[], num_computed_tokens=m.num_computed)
        before = batch_state(self.batch)
        with pytest.raises(AssertionError, match="gap"):
            self.batch.update(delta)
        assert_same_state(before, batch_state(self.batch))

    @rule(data=st.data())
    def apply_plan(self, data):
        """A whole driver step: removals, admissions into the lowest free slots, deltas."""
        removed = data.draw(st.lists(st.sampled_from(sorted(self.model)), unique=True,
                                     max_size=3)) if self.model else []
        for req_id in removed:
            del self.model[req_id]
            del self.rows[req_id]
        free_ids = [r for r in REQ_POOL if r not in self.model and r not in removed]
        num_new = data.draw(st.integers(0, min(2, MAX_SEQS - len(self.model), len(free_ids))))
        new_ids = data.draw(st.lists(st.sampled_from(free_ids), unique=True,
                                     min_size=num_new, max_size=num_new)) if num_new else []
        new_reqs = [self._new_request(data, r) for r in new_ids]
        cached_ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), unique=True)) \
            if self.model else []
        cached = [self._delta(data, r, data.draw(st.booleans())) for r in cached_ids]
        order = cached_ids + new_ids  # the layout order: cached, then new (StepPlan.check)
        plan = StepPlan(step_id=0, removed_req_ids=removed, new_reqs=new_reqs,
                        cached_reqs=CachedRequestData.of(cached), scheduled_req_ids=order,
                        num_scheduled_tokens=[1] * len(order))
        gen = self.batch.generation.copy()
        before = dict(self.batch.req_id_to_slot)
        self.batch.apply_plan(plan)
        rows = self.batch.req_id_to_slot
        for r in self.model:  # survivors never move
            assert rows[r] == before[r], f"{r!r} moved from slot {before[r]} to {rows[r]}"
        freed = sorted(set(range(MAX_SEQS)) - {before[r] for r in self.model})
        assert sorted(rows[n.req_id] for n in new_reqs) == freed[:len(new_reqs)], \
            "admissions did not take the lowest free slots"
        for delta in cached:
            self._apply_delta_to_model(delta)
        for new in new_reqs:
            # the generation is bumped exactly once per admission into a row
            self._admit(new, rows[new.req_id], gen)
        self.rows = {r: rows[r] for r in self.model}

    # -- after every rule
    @invariant()
    def consistent(self):
        self.batch.check()
        assert self.batch.req_id_to_slot == self.rows
        assert_matches_model(self.batch, self.model)
        self._check_generations()

    def _check_generations(self):
        """A slot's generation counts its tenants: it never goes back, grows whenever a
        request is admitted into the slot, and stays put otherwise (invariant 3)."""
        gen, tenants = self.batch.generation, self.batch.req_ids
        for row in range(MAX_SEQS):
            old, new = int(self.prev_generation[row]), int(gen[row])
            if tenants[row] is not None and tenants[row] != self.prev_tenants[row]:
                assert new > old, \
                    f"row {row}: new tenant {tenants[row]!r}, generation {old} -> {new}"
            else:
                assert new == old, f"row {row}: same tenant, generation {old} -> {new}"
        self.prev_tenants = list(tenants)
        self.prev_generation = gen.copy()


InputBatchMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestInputBatchMachine = InputBatchMachine.TestCase


# ---- 2. slot reuse (docs/invariants.md, 3) ------------------------------------------------------------
def _request_a() -> NewRequestData:
    return NewRequestData(req_id="A", incarnation=1, token_ids=list(range(100, 120)),
                          num_prompt_tokens=20, num_computed_tokens=0,
                          block_ids=[1, 2, 3, 4, 5], sampling=SamplingParams(temperature=0.0))


def _request_b() -> NewRequestData:
    # resumed / disaggregated: arrives already prefilled, and shorter than A's known prefix
    return NewRequestData(req_id="B", incarnation=3, token_ids=list(range(7, 17)),
                          num_prompt_tokens=7, num_computed_tokens=9,
                          block_ids=[40, 41, 42], sampling=SamplingParams(temperature=0.8, seed=5))


def _assert_row_is_b(b: InputBatch, row: int, new_b: NewRequestData, gen_a: int) -> None:
    n = len(new_b.token_ids)
    assert b.req_id_to_slot == {"B": row} and b.req_ids[row] == "B"
    assert b.token_ids[row, :n].tolist() == new_b.token_ids
    assert (b.token_ids[row, n:] == POISON).all(), "A's tokens survived past B's prefix"
    assert b.num_tokens_known[row] == n
    assert b.num_prompt_tokens[row] == new_b.num_prompt_tokens
    assert b.num_computed_tokens[row] == new_b.num_computed_tokens
    assert b.last_sampled_token[row] == new_b.token_ids[-1], "A's last token would feed B"
    assert b.num_blocks[row] == len(new_b.block_ids)
    assert b.block_table[row, :3].tolist() == new_b.block_ids
    assert (b.block_table[row, 3:] == 0).all(), "A's block ids survived in B's block table"
    assert b.sampling[row] is new_b.sampling
    assert b.incarnation[row] == new_b.incarnation
    assert b.generation[row] == gen_a + 1
    b.check()


def test_slot_reuse_initializes_every_field():
    b = InputBatch(4, 64, 4)
    row = b.add(_request_a())
    gen_a = int(b.generation[row])
    b.mark_computed("A", 20)
    b.update(CachedRequest(req_id="A", token_start=20, new_token_ids=[500, 501, 502],
                               new_block_ids=[6, 7], num_computed_tokens=20))
    b.append_tokens("A", [503, 504])
    b.mark_computed("A", 4)
    assert b.last_sampled_token[row] == 504 and b.num_tokens_known[row] == 25
    b.check()

    b.remove("A")
    assert_hole_clear(b, row)
    new_b = _request_b()
    assert b.add(new_b) == row
    _assert_row_is_b(b, row, new_b, gen_a)


def test_slot_reuse_through_one_plan():
    """The driver's path: A's removal and B's admission in the same StepPlan."""
    b = InputBatch(4, 64, 4)
    b.apply_plan(StepPlan(0, [], [_request_a()], CachedRequestData(), ["A"], [20]))
    b.mark_computed("A", 20)
    delta = CachedRequest(req_id="A", token_start=20, new_token_ids=[500],
                              new_block_ids=[6], num_computed_tokens=20)
    b.apply_plan(StepPlan(1, [], [], CachedRequestData.of([delta]), ["A"], [1]))
    b.mark_computed("A", 1)
    row = b.req_id_to_slot["A"]
    gen_a = int(b.generation[row])
    assert b.last_sampled_token[row] == 500
    new_b = _request_b()
    b.apply_plan(StepPlan(2, ["A"], [new_b], CachedRequestData(), ["B"], [1]))
    assert b.req_id_to_slot["B"] == row
    _assert_row_is_b(b, row, new_b, gen_a)


# ---- 3 and 4. invariant 1: chunked prefill while other requests finish around it --------
@dataclass
class _DriverReq:
    req_id: str
    prompt: list[int]
    max_tokens: int
    chunk: int  # the most tokens scheduled per step (the token budget share)
    outputs: list[int] = field(default_factory=list)
    computed: int = 0
    sent: int = 0  # tokens already in the ranks' batches
    blocks: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs


def run_chunked_prefill_scenario(batch_cls=InputBatch, *, use_check: bool = True,
                                 compare_counters: bool = True) -> int:
    """A driver as the scheduler runs it (sync: one plan, forward, commit), against one rank's
    batch. Long request L (50-token prompt, chunks of 8) sits in the last slot while short
    requests in earlier slots decode and finish at staggered steps: the scenario in which a
    condensing batch moved L during its chunked prefill (vLLM's token loss). After every plan
    and every mark_computed the batch is checked (check(), if use_check) and compared with
    the driver's truth: the slot's first len(prompt) tokens are the prompt, then (if
    compare_counters) the counters. Returns how many times L changed slot during its
    prefill (with stable slots: never)."""
    rng = np.random.default_rng(0)
    batch = batch_cls(max_num_seqs=6, max_model_len=64, block_size=4)
    reqs = [
        _DriverReq("S0", rng.integers(3, 1000, 3).tolist(), max_tokens=2, chunk=64),
        _DriverReq("S1", rng.integers(3, 1000, 3).tolist(), max_tokens=3, chunk=64),
        _DriverReq("S2", rng.integers(3, 1000, 3).tolist(), max_tokens=1, chunk=64),
        _DriverReq("L", rng.integers(3, 1000, 50).tolist(), max_tokens=3, chunk=8),
    ]
    long_req = reqs[-1]
    running = list(reqs)
    removed: list[str] = []
    next_block = 1
    moves_in_prefill = 0
    last_row: Optional[int] = None

    def verify(when: str) -> None:
        if use_check:
            batch.check()
        for r in running:
            row = batch.req_id_to_slot[r.req_id]
            n = len(r.prompt)
            assert batch.token_ids[row, :n].tolist() == r.prompt, \
                f"{when}: {r.req_id!r} row {row}: prompt tail lost " \
                f"({int((batch.token_ids[row, :n] == POISON).sum())} POISON tokens)"
        if not compare_counters:
            return
        for r in running:
            row = batch.req_id_to_slot[r.req_id]
            assert batch.num_tokens_known[row] == r.sent, \
                f"{when}: {r.req_id!r}: known {int(batch.num_tokens_known[row])} != {r.sent}"
            assert batch.token_ids[row, :r.sent].tolist() == r.tokens[:r.sent]
            assert batch.num_computed_tokens[row] == r.computed

    for step in range(20):
        if not running:
            break
        new_reqs, cached, scheduled, num_sched = [], [], [], []
        new_sched = []  # (req_id, tokens) of the new ones: laid out after the cached ones
        for r in running:
            n = min(len(r.tokens) - r.computed, r.chunk)
            need = -(-(r.computed + n) // 4) - len(r.blocks)
            new_blocks = list(range(next_block, next_block + need))
            next_block += need
            r.blocks += new_blocks
            if r.sent == 0:
                new_reqs.append(NewRequestData(
                    req_id=r.req_id, incarnation=1, token_ids=list(r.tokens),
                    num_prompt_tokens=len(r.prompt), num_computed_tokens=0,
                    block_ids=new_blocks, sampling=SamplingParams(max_tokens=r.max_tokens)))
            else:
                # during L's chunked prefill: no new tokens, only blocks
                cached.append(CachedRequest(
                    req_id=r.req_id, token_start=r.sent, new_token_ids=r.tokens[r.sent:],
                    new_block_ids=new_blocks, num_computed_tokens=r.computed))
            first = r.sent == 0
            r.sent = len(r.tokens)
            if first:
                new_sched.append((r.req_id, n))
            else:
                scheduled.append(r.req_id)
                num_sched.append(n)
        scheduled += [r for r, _ in new_sched]
        num_sched += [n for _, n in new_sched]
        plan = StepPlan(step, removed, new_reqs, CachedRequestData.of(cached), scheduled, num_sched)
        batch.apply_plan(plan)
        verify(f"step {step} after apply_plan")

        row = batch.req_id_to_slot[long_req.req_id]
        if last_row is not None and row != last_row and long_req.computed < len(long_req.prompt):
            moves_in_prefill += 1
            # the moved row holds the whole prompt and its counter stayed at the prompt length
            assert batch.token_ids[row, :len(long_req.prompt)].tolist() == long_req.prompt
            if compare_counters:
                assert batch.num_tokens_known[row] == len(long_req.prompt)
                assert batch.num_computed_tokens[row] < batch.num_tokens_known[row]
        last_row = row

        ran = dict(zip(scheduled, num_sched))
        for r in running:
            n = ran[r.req_id]
            batch.mark_computed(r.req_id, n)
            r.computed += n
        verify(f"step {step} after mark_computed")

        # the last rank samples for every request that reached the end of its known prefix
        removed = []
        for r in list(running):
            if r.computed == len(r.tokens):
                r.outputs.append(1000 + 10 * step + len(r.outputs))
                if len(r.outputs) >= r.max_tokens:
                    running.remove(r)
                    removed.append(r.req_id)
    assert not running, "scenario did not finish"
    assert len(long_req.outputs) == long_req.max_tokens
    return moves_in_prefill


def test_slots_stay_put_during_chunked_prefill_and_keep_the_prompt():
    assert run_chunked_prefill_scenario(InputBatch) == 0


class BuggyInputBatch(InputBatch):
    """vLLM's bug (docs/invariants.md, 1): on update, the known-prefix counter is rebuilt from
    num_computed_tokens instead of growing from its own value."""

    def update(self, delta: CachedRequest) -> None:
        super().update(delta)
        row = self.req_id_to_slot[delta.req_id]
        self.num_tokens_known[row] = delta.num_computed_tokens + len(delta.new_token_ids)


def test_planted_counter_bug_is_caught_by_check():
    with pytest.raises(AssertionError, match="shorter than its prompt"):
        run_chunked_prefill_scenario(BuggyInputBatch)


def test_content_only_detector_passes_on_the_real_class():
    assert run_chunked_prefill_scenario(InputBatch, use_check=False, compare_counters=False) == 0


def test_planted_bug_is_harmless_outside_chunked_prefill():
    """Sanity of the planted bug: for decode-only deltas it computes the right counter,
    which is why only chunked prefill (computed < prompt) exposed it."""
    b = BuggyInputBatch(2, 64, 4)
    b.add(NewRequestData("D", 1, [1, 2, 3], 3, 0, [1], SamplingParams()))
    b.mark_computed("D", 3)
    b.update(CachedRequest(req_id="D", token_start=3, new_token_ids=[9], new_block_ids=[],
                               num_computed_tokens=3))
    b.check()
    assert b.num_tokens_known[0] == 4


# ---- the per-slot generation counter --------------------------------------------------
def test_generation_grows_with_each_tenant_and_only_then():
    """Each tenant of a slot gets a fresh, larger generation, so a late result keyed by
    (slot, generation) never matches the slot's next request; other slots keep theirs."""
    b = InputBatch(4, 64, 4)

    def new(req_id: str) -> NewRequestData:
        return NewRequestData(req_id, 1, [5, 6], 2, 0, [1], SamplingParams())

    gens_slot0 = []
    b.add(new("a1"))
    gens_slot0.append(int(b.generation[0]))
    b.add(new("b"))  # slot 1
    gen_slot1 = int(b.generation[1])
    for req_id in ("a2", "a3", "a4"):  # slot 0's next tenants
        b.remove(b.req_ids[0])
        assert b.add(new(req_id)) == 0, "the lowest free slot is taken first"
        gens_slot0.append(int(b.generation[0]))
    assert all(x < y for x, y in zip(gens_slot0, gens_slot0[1:])), \
        f"slot 0 generations {gens_slot0} do not grow with each tenant"
    assert b.generation[1] == gen_slot1 and b.req_id_to_slot["b"] == 1, "slot 1 was touched"
    b.remove("a4")
    assert b.req_id_to_slot == {"b": 1}, "b moved when slot 0 was freed"
    b.check()


_GREEDY = SamplingParams(temperature=0.0)


def _three_rows() -> InputBatch:
    b = InputBatch(MAX_SEQS, MAX_LEN, BS)
    for i, n in enumerate((5, 9, MAX_LEN - 1)):
        b.add(NewRequestData(req_id=f"q{i}", incarnation=i, token_ids=list(range(10 * i, 10 * i + n)),
                             num_prompt_tokens=n, num_computed_tokens=n - 1,
                             block_ids=list(range(16 * i, 16 * i + MAX_BLOCKS)),
                             sampling=_GREEDY))
    return b


@pytest.mark.parametrize("samples,drafts", [
    ([[7], [8], [9]], None),  # the array path
    ([[7], [3, 8], [9]], [3, 5]),  # q1's first draft accepted: the per-request path
    ([[7], [8], [9]], [1, 2]),  # q1's drafts rejected: the per-request path
])
def test_append_samples_equals_append_then_resolve(samples, drafts):
    """The batched append must leave exactly the state of the per-request calls."""
    ids = ["q0", "q1", "q2"]
    fast, slow = _three_rows(), _three_rows()
    for b in (fast, slow):
        if drafts:
            b.set_drafts("q1", drafts)
        b.mark_computed_rows(np.array([0, 1, 2]), np.array([1, 1 + len(drafts or []), 1]))
    fast.append_samples(ids, samples)
    for r, toks in zip(ids, samples):
        slow.append_tokens(r, toks)
        slow.resolve_drafts(r, len(toks) - 1)
    assert_same_state(batch_state(slow), batch_state(fast))
    fast.check()


def test_mark_computed_rows_equals_one_by_one():
    fast, slow = _three_rows(), _three_rows()
    for b in (fast, slow):
        b.set_drafts("q0", [4, 4])
    fast.mark_computed_rows(np.array([2, 0]), np.array([1, 3]))
    slow.mark_computed("q2", 1)
    slow.mark_computed("q0", 3)
    assert_same_state(batch_state(slow), batch_state(fast))
    assert fast.num_unresolved_drafts[0] == 2 and fast.num_computed_tokens[0] == 4 + 1
