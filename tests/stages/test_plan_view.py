"""plan_view reads the plan's columns in place (the layout order: cached, then new). Checked
against a reading of the plan's records by request id, on plans of every kind of entry: a
decode token, a prefill chunk with nothing new, drafts, a self-drafted request, new requests;
and num_samples (what a failed step's message is sized by) against the view's own count."""
import random

import numpy as np

from ray_runtime.messages import CachedRequest, CachedRequestData, NewRequestData, StepPlan
from ray_runtime.sampling_params import SamplingParams
from stages.input_batch import InputBatch
from stages.plan_view import plan_view
from stages.token_feedback import num_samples


def _by_records(plan: StepPlan, batch: InputBatch):
    """The view computed per request from records, looked up by id."""
    view = {n.req_id: (n.num_computed_tokens, len(n.token_ids), 0) for n in plan.new_reqs}
    digest = {r: v[1] for r, v in view.items()}
    num_new = dict(zip(plan.scheduled_req_ids, plan.num_scheduled_tokens))
    for d in plan.cached_reqs:
        known = d.token_start + len(d.new_token_ids)
        view[d.req_id] = (d.num_computed_tokens, known, len(d.draft_token_ids))
        digest[d.req_id] = known
        if d.self_drafted:
            slot = batch.req_id_to_slot[d.req_id]
            nd = int(batch.num_draft_tokens[slot])
            num_new[d.req_id] = 1 + nd
            landed = int(batch.num_tokens_known[slot])
            view[d.req_id] = (int(batch.num_computed_tokens[slot]),
                              landed + int(batch.num_pending_samples[slot]), nd)
            digest[d.req_id] = landed
    ids = plan.scheduled_req_ids
    return (np.array([batch.req_id_to_slot[r] for r in ids]), np.array([view[r][0] for r in ids]),
            np.array([num_new[r] for r in ids]), np.array([view[r][1] for r in ids]),
            np.array([view[r][2] for r in ids]), np.array([digest[r] for r in ids]))


def _new(req_id: str, n: int) -> NewRequestData:
    return NewRequestData(req_id, 1, list(range(3, 3 + n)), n, 0, [0, 1, 2, 3],
                          SamplingParams(max_tokens=64))


def test_the_view_of_the_columns_equals_the_view_of_the_records():
    rng = random.Random(0)
    batch = InputBatch(max_num_seqs=32, max_model_len=256, block_size=16)
    for step in range(30):
        ids = [f"s{step}r{i}" for i in range(rng.randrange(1, 6))]
        for r in ids:  # rows that hold a prompt, some of it computed, some drafts
            slot = batch.add(_new(r, rng.randrange(4, 30)))
            batch.num_computed_tokens[slot] = rng.randrange(0, int(batch.num_tokens_known[slot]))
            if rng.random() < 0.4:
                batch.set_drafts(r, [7] * rng.randrange(1, 4))
        entries, nums = [], []
        for r in ids:
            slot = batch.req_id_to_slot[r]
            known = int(batch.num_tokens_known[slot])
            computed = int(batch.num_computed_tokens[slot])
            kind = rng.choice(["decode", "chunk", "drafts", "self"])
            if kind == "self":
                nd = int(batch.num_draft_tokens[slot])
                if not nd and rng.random() < 0.5:  # its last step's sample not landed yet
                    batch.expect_samples(np.array([slot]))
                entries.append(CachedRequest(r, known, [], [], computed, None, [], True))
                nums.append(1 + nd + rng.randrange(0, 2))
            elif kind == "drafts":
                entries.append(CachedRequest(r, known, [5], [], computed, None, [8, 9]))
                nums.append(known + 1 - computed + 2)
            elif kind == "chunk":
                entries.append(CachedRequest(r, known, [], [4], computed))
                nums.append(rng.randrange(1, known - computed + 1))
            else:
                entries.append(CachedRequest(r, known, [6], [], computed))
                nums.append(known + 1 - computed)
        new = [_new(f"s{step}n{i}", rng.randrange(2, 20)) for i in range(rng.randrange(0, 3))]
        plan = StepPlan(step, [], new, CachedRequestData.of(entries),
                        ids + [n.req_id for n in new], nums + [rng.randrange(1, 3) for _ in new])
        batch.apply_plan(plan)
        view = plan_view(plan, batch)
        want = _by_records(plan, batch)
        got = (view.slots, view.starts, view.num_new, view.known, view.num_drafts, view.digest_len)
        for name, g, w in zip(("slots", "starts", "num_new", "known", "drafts", "digest_len"),
                              got, want):
            assert g.tolist() == w.tolist(), f"step {step}: {name}"
        if not any(e.self_drafted for e in entries):  # num_samples reads the plan alone
            assert num_samples(plan) == int(((view.starts + view.num_new) >= view.known).sum())
        for r in plan.scheduled_req_ids:
            batch.remove(r)
