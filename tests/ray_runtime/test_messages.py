"""The columnar wire formats (ray_runtime/messages.py): CachedRequestData and RowDigests hold
one list per field; their records survive the columns and a msgpack round trip, a column of
the wrong length is refused, and a plan's layout order is the cached requests then the new
ones (StepPlan.check), which plan_view and num_samples read entries by."""
import random

import pytest

from ray_runtime.messages import (CachedRequest, CachedRequestData, NewRequestData, RowDigest,
                                  RowDigests, StageStepResult, StageTiming, StepPlan, decode_plan,
                                  decode_result, encode)
from ray_runtime.reconcile import audit
from ray_runtime.sampling_params import SamplingParams


def _records(rng: random.Random, n: int) -> list[CachedRequest]:
    out = []
    for i in range(n):
        out.append(CachedRequest(
            f"r{i}", rng.randrange(0, 500),
            [rng.randrange(3, 999) for _ in range(rng.choice([0, 1, 1, 3]))],
            [rng.randrange(1, 99) for _ in range(rng.choice([0, 0, 1, 2]))], rng.randrange(0, 500),
            rng.choice([None, rng.randrange(0, 9)]),
            [rng.randrange(3, 999) for _ in range(rng.choice([0, 0, 2]))], rng.random() < 0.2))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_cached_records_survive_the_columns_and_the_wire(seed):
    rng = random.Random(seed)
    records = _records(rng, 40)
    cached = CachedRequestData.of(records)
    cached.check()
    assert list(cached) == records and len(cached) == 40
    assert cached[7] == records[7] and cached.records([3, 9]) == [records[3], records[9]]
    assert cached[-1] == records[-1] and cached[-40] == records[0] and cached[5:9] == records[5:9]
    with pytest.raises(IndexError):
        cached[40]
    plan = StepPlan(5, ["gone"], [], cached, list(cached.req_ids), [1] * 40)
    plan.check()
    back = decode_plan(encode(plan))
    assert list(back.cached_reqs) == records and back == plan


def test_a_record_is_read_only():
    """Records are copies of the columns: writing one would change nothing, so it raises."""
    rec = CachedRequestData.of(_records(random.Random(0), 2))[1]
    with pytest.raises(AttributeError):
        rec.token_start = 3


def test_columns_of_the_wrong_length_are_refused():
    cached = CachedRequestData.of(_records(random.Random(1), 5))
    cached.token_starts.pop()
    with pytest.raises(ValueError, match="token_starts: 4 entries for 5 requests"):
        cached.check()
    cached = CachedRequestData.of(_records(random.Random(1), 5))
    cached.new_token_ids.append(7)
    with pytest.raises(ValueError, match="new_token_ids"):
        cached.check()
    cached = CachedRequestData.of(_records(random.Random(1), 5))
    cached.num_new_tokens[0] -= 1
    cached.num_new_tokens[1] = -1
    with pytest.raises(ValueError, match="negative count"):
        cached.check()
    cached = CachedRequestData.of(_records(random.Random(1), 5))
    cached.block_starts[2] = -2
    with pytest.raises(ValueError, match="block_starts"):
        cached.check()
    records = [CachedRequest("a", 1, [5], [7, 8], 0), CachedRequest("b", 1, [5], [], 0, None, [9]),
               CachedRequest("c", 1, [5], [6], 0, None, [9, 9], True)]
    assert CachedRequestData.of(records).block_entries == [0, 2]  # rare fields: sparse
    for field, value, what in (("block_entries", [2, 0], "not ascending"),
                               ("draft_entries", [1, 3], "not ascending"),
                               ("self_drafted", [5], "not ascending"),
                               ("num_new_blocks", [2, 2], "num_new_blocks"),
                               ("num_drafts", [0, 3], "num_drafts")):
        cached = CachedRequestData.of(records)
        setattr(cached, field, value)
        with pytest.raises(ValueError, match=what):
            cached.check()
    digests = RowDigests(["a", "b"], [1, 1], [3, 3], [3, 3], [2, 2], [5, 5], [0, 0], [0])
    with pytest.raises(ValueError, match="num_draft_tokens: 1 entries for 2 requests"):
        digests.check()
    with pytest.raises(ValueError, match="num_draft_tokens"):  # the audit refuses it too
        audit({}, digests, 0, False)


def _new(req_id: str) -> NewRequestData:
    return NewRequestData(req_id, 1, [3, 4, 5], 3, 0, [1], SamplingParams())


def test_the_layout_order_is_cached_then_new():
    cached = CachedRequestData.of([CachedRequest("a", 5, [9], [], 5),
                                   CachedRequest("b", 5, [9], [], 5)])
    StepPlan(1, [], [_new("c")], cached, ["a", "b", "c"], [1, 1, 3]).check()
    for order in (["b", "a", "c"], ["c", "a", "b"], ["a", "b"]):
        with pytest.raises(ValueError, match="cached requests then the new ones"):
            StepPlan(1, [], [_new("c")], cached, order, [1] * len(order)).check()
    with pytest.raises(ValueError, match="num_scheduled_tokens"):
        StepPlan(1, [], [_new("c")], cached, ["a", "b", "c"], [1, 1]).check()
    with pytest.raises(ValueError, match="named twice"):
        StepPlan(1, [], [_new("a")], cached, ["a", "b", "a"], [1, 1, 1]).check()


def test_digest_columns_round_trip_and_records():
    rng = random.Random(2)
    records = [RowDigest(f"r{i}", rng.randrange(1, 4), rng.randrange(500), rng.randrange(500),
                         rng.randrange(500), rng.getrandbits(64), rng.randrange(2), rng.randrange(3))
               for i in range(30)]
    digests = RowDigests.of(records)
    digests.check()
    assert list(digests) == records and digests[4] == records[4] and len(digests) == 30
    assert digests[-1] == records[-1] and digests[2:5] == records[2:5]
    assert RowDigests.of([]) == RowDigests()
    timing = StageTiming(1.0, 1.0, 1.0, 1.0, 0.0)
    back = decode_result(encode(StageStepResult(3, 1, timing, digests)))
    assert list(back.digests) == records
    # a 64-bit hash stays an exact int through the columns
    assert [d.token_hash for d in back.digests] == [r.token_hash for r in records]
    assert all(type(h) is int for h in back.digests.token_hash)


def test_no_message_struct_is_tracked_by_the_collector():
    """gc=False: a step builds and decodes them by the hundred (plain data, no cycles)."""
    import gc

    cached = CachedRequestData.of(_records(random.Random(3), 3))
    plan = decode_plan(encode(StepPlan(1, [], [_new("n")], cached,
                                       list(cached.req_ids) + ["n"], [1, 1, 1, 3])))
    for obj in (plan, plan.cached_reqs, plan.new_reqs[0], cached[0], RowDigests()):
        assert not gc.is_tracked(obj), type(obj).__name__


def test_rank_host_cost_bench_times_bookkeeping_the_driver_accepts():
    """bench/rank_host_cost.py: a real rank's digests equal the echo ranks' on every plan (it
    raises otherwise), and every phase is timed."""
    from bench.rank_host_cost import PHASES, run_once

    out = run_once(rows=16, steps=12, prompt_len=24)
    assert out["checked"] >= 12
    assert all(out["us"][k] > 0 for k in PHASES)
