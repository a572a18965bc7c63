"""One view of a step's plan on a rank, computed once, right after the plan is applied: per
scheduled request, in layout order, what it runs. Input building and the digests both read it.

The self-drafted rule lives here and nowhere else on the rank's read side (InputBatch.update
applies it on the write side: it leaves a self-drafted slot's own count standing). At PP=1
async with drafts the driver plans a request's next step before it has seen the drafts, so
the rank runs its own latest token and drafts (1 + drafts tokens, at most what was planned)
from its own computed count, and the digest covers its own known prefix: the driver corrects
its optimistic view when the previous step's result lands, and audits the corrected one.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_runtime.messages import StepPlan


@dataclass
class PlanView:
    req_ids: list[str]  # the plan's scheduled requests, in layout order
    slots: np.ndarray  # [n]
    starts: np.ndarray  # [n] position of the first token each runs
    num_new: np.ndarray  # [n] tokens each runs (the plan's, or 1 + drafts if self-drafted)
    known: np.ndarray  # [n] the known prefix the step stands on, pending samples counted
    num_drafts: np.ndarray  # [n] drafts among the tokens each runs
    digest_len: np.ndarray  # [n] prefix the digest hashes: the driver's count, or the rank's
    # own landed count for a self-drafted request (its pending samples have no value yet)


def plan_view(plan: StepPlan, batch) -> PlanView:
    """`batch`: the InputBatch the plan was just applied to."""
    view = {n.req_id: (n.num_computed_tokens, len(n.token_ids), 0) for n in plan.new_reqs}
    view.update({d.req_id: (d.num_computed_tokens, d.token_start + len(d.new_token_ids),
                            len(d.draft_token_ids)) for d in plan.cached_reqs})
    req_ids = plan.scheduled_req_ids
    num_new = np.array(plan.num_scheduled_tokens, np.int64)
    slots = np.fromiter((batch.req_id_to_slot[r] for r in req_ids), np.int64, len(req_ids))
    digest_len = np.fromiter((view[r][1] for r in req_ids), np.int64, len(req_ids))
    self_drafted = [d.req_id for d in plan.cached_reqs if d.self_drafted]
    if self_drafted:
        index = {r: i for i, r in enumerate(req_ids)}
        for req_id in self_drafted:
            slot, i = batch.req_id_to_slot[req_id], index[req_id]
            nd = int(batch.num_draft_tokens[slot])
            if 1 + nd > num_new[i]:
                raise AssertionError(f"request {req_id!r}: {nd} drafts but {num_new[i]} tokens planned")
            num_new[i] = 1 + nd
            landed = int(batch.num_tokens_known[slot])
            view[req_id] = (int(batch.num_computed_tokens[slot]),
                            landed + int(batch.num_pending_samples[slot]), nd)
            digest_len[i] = landed
    starts = np.fromiter((view[r][0] for r in req_ids), np.int64, len(req_ids))
    known = np.fromiter((view[r][1] for r in req_ids), np.int64, len(req_ids))
    drafts = np.fromiter((view[r][2] for r in req_ids), np.int64, len(req_ids))
    return PlanView(req_ids, slots, starts, num_new, known, drafts, digest_len)
