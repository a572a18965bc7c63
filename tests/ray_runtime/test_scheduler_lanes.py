"""Micro-batches as lanes (Scheduler num_lanes > 1, PP>1 with token feedback), driven directly:
every plan runs one lane's requests only; the lanes take turns and stay even as requests come
and go; a lane's next step is planned on its pending samples while its running step is out
(two plans per lane in flight, never more, never one request twice beyond its placeholder);
and the committed outputs are the ones a single lane (PP=1) gives."""
from __future__ import annotations

from collections import deque

from ray_runtime.messages import SamplerOutput
from ray_runtime.request import Request
from ray_runtime.sampling_params import SamplingParams
from ray_runtime.scheduler import Scheduler


def token_of(req: Request, output_index: int) -> int:
    return 1000 + 37 * req.arrival_index + output_index


def run(num_lanes: int, prompts: list[list[int]], max_tokens: list[int], inflight: int,
        budget: int = 64, arrive_late: int = 0):
    """Plan up to `inflight` steps ahead, answer the oldest, repeat. Returns the outputs, the
    plans' lanes and the most plans one request had in flight."""
    s = Scheduler(max_num_seqs=16, max_num_batched_tokens=budget, num_kv_blocks=512,
                  block_size=4, max_model_len=512, allow_placeholders=True, num_lanes=num_lanes)
    reqs = []

    def add(i):
        r = Request(f"r{i}", prompts[i], SamplingParams(max_tokens=max_tokens[i], ignore_eos=True),
                    frozenset(), i)
        reqs.append(r)
        s.add_request(r)

    for i in range(len(prompts) - arrive_late):
        add(i)
    out_index = {}  # request -> outputs sampled so far (by the "last rank", ahead of commits)
    inflight_q: deque = deque()
    lanes_seen, most_in_flight, steps = [], 0, 0
    run.active = []  # per plan: how many lanes had running requests when it was made
    while s.has_unfinished() or inflight_q:
        while len(inflight_q) < inflight:
            rec = s.schedule()
            if rec is None:
                break
            lanes = {s.requests[r].lane for r in rec.plan.scheduled_req_ids}
            assert len(lanes) == 1, f"step {rec.plan.step_id} mixes lanes {lanes}"
            lanes_seen.append(lanes.pop())
            run.active.append(len({r.lane for r in s.running}))
            inflight_q.append(rec)
            for r in rec.plan.scheduled_req_ids:
                most_in_flight = max(most_in_flight, s.requests[r].num_inflight_steps)
        rec = inflight_q.popleft()
        steps += 1
        if steps == 6 and arrive_late:
            for i in range(len(prompts) - arrive_late, len(prompts)):
                add(i)
        ids = [r for r in rec.plan.scheduled_req_ids if r in rec.sampling]
        toks = []
        for r in ids:
            req = s.requests[r]
            k = out_index.get((r, req.incarnation), 0)
            toks.append([token_of(req, k)])
            out_index[(r, req.incarnation)] = k + 1
        s.update_from_output(rec, SamplerOutput(rec.plan.step_id, ids,
                                                [rec.expected[r].incarnation for r in ids], toks))
        s.check()
        s.pop_finished()
    outs = {r.req_id: r.token_ids[r.num_prompt_tokens:] for r in reqs}
    return outs, lanes_seen, most_in_flight


def test_lanes_take_turns_and_plan_ahead_on_pending_samples():
    prompts = [[3 + i] * (5 + i) for i in range(8)]
    budgets = [12] * 8
    outs, lanes, most = run(2, prompts, budgets, inflight=4)
    ref, _, _ = run(1, prompts, budgets, inflight=1)
    assert outs == ref
    assert all(len(o) == 12 for o in outs.values())
    assert most == 2, "a lane's next step runs on its pending samples: two steps in flight"
    decode = lanes[4:-4]
    assert decode and all(a != b for a, b in zip(decode, decode[1:])), f"lanes did not alternate: {lanes}"


def test_lanes_stay_even_when_requests_arrive_later_and_finish_staggered():
    prompts = [[5] * 7 for _ in range(9)]
    budgets = [3, 20, 5, 9, 14, 2, 11, 6, 8]
    outs, lanes, _ = run(3, prompts, budgets, inflight=6, budget=16, arrive_late=4)
    ref, _, _ = run(1, prompts, budgets, inflight=1, budget=16, arrive_late=4)
    assert outs == ref
    assert set(lanes) == {0, 1, 2}


def test_one_request_runs_alone_in_its_lane():
    outs, lanes, most = run(2, [[7, 8, 9]], [10], inflight=4)
    assert len(outs["r0"]) == 10 and set(lanes) == {0} and most == 2


def test_a_queue_deeper_than_max_num_seqs_fills_every_lane():
    """Short prompts, a budget that admits all of them at once and more requests waiting than
    max_num_seqs: each lane gets its share of the slots there are (max_num_seqs / lanes), not
    the first lane all of them (which left the other micro-batches empty: PP>1 ran one
    micro-batch at a time)."""
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=4096, num_kv_blocks=512, block_size=4,
                  max_model_len=512, allow_placeholders=True, num_lanes=2)
    for i in range(40):
        s.add_request(Request(f"r{i}", [5] * 8, SamplingParams(max_tokens=4, ignore_eos=True),
                              frozenset(), i))
    first, second = s.schedule(), s.schedule()
    assert len(first.plan.scheduled_req_ids) == len(second.plan.scheduled_req_ids) == 4
    assert {s.requests[r].lane for r in first.plan.scheduled_req_ids} == {0}
    assert {s.requests[r].lane for r in second.plan.scheduled_req_ids} == {1}
    s.check()


def test_lanes_stay_even_with_a_deep_queue_through_the_run():
    prompts = [[4 + i % 5] * 6 for i in range(40)]
    budgets = [3 + (i * 7) % 11 for i in range(40)]
    outs, lanes, _ = run(4, prompts, budgets, inflight=8, budget=512)
    ref, _, _ = run(1, prompts, budgets, inflight=1, budget=512)
    assert outs == ref
    assert lanes[:8] == [0, 1, 2, 3] * 2, f"a lane went unplanned while the queue was deep: {lanes}"
    counts = [lanes[:40].count(k) for k in range(4)]
    assert max(counts) - min(counts) <= 1, counts


def test_a_lane_is_not_planned_twice_in_a_row_while_other_lanes_run():
    """Found on 4x H200 (docs/benchmarks.md, the deep queue at PP=4): when the other lanes
    had both their steps in flight, the scheduler planned a lane's next step right after its
    previous one (a request admitted, then its first decode on the pending sample). Rank 0
    runs steps in plan order, so it then waits a whole pipeline round trip for the samples
    of the step just before: the lanes paired up (A A B B ...) and every stage idled ~60%.
    With other lanes running, a lane's steps are spaced by theirs: the driver waits for a
    reply instead of planning out of turn."""
    prompts = [[4 + i % 5] * 6 for i in range(96)]
    budgets = [24] * 96  # waves: a lane's requests finish together and new ones come in
    outs, lanes, _ = run(4, prompts, budgets, inflight=8, budget=512)
    active = run.active
    ref, _, _ = run(1, prompts, budgets, inflight=1, budget=512)
    assert outs == ref
    adjacent = [i for i in range(1, len(lanes)) if lanes[i] == lanes[i - 1] and active[i] > 1]
    assert not adjacent, (f"{len(adjacent)} plans of the lane planned just before, other lanes "
                          f"running: first at plan {adjacent[0]}, lanes {lanes[adjacent[0] - 6:adjacent[0] + 6]}")
