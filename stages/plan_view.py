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
    prefill_shaped: bool = False  # the plan's: the step runs the prefill split's blocks


def planned_spans(plan: StepPlan) -> tuple[np.ndarray, np.ndarray]:
    """Per scheduled request, in layout order, as the plan states it: the position its tokens
    start at, and the known prefix they stand on (before the self-drafted rule)."""
    cached, new = plan.cached_reqs, plan.new_reqs
    starts = np.array(cached.num_computed_tokens + [n.num_computed_tokens for n in new], np.int64)
    known = np.concatenate([np.array(cached.token_starts, np.int64)
                            + np.array(cached.num_new_tokens, np.int64),
                            np.array([len(n.token_ids) for n in new], np.int64)])
    return starts, known


def plan_view(plan: StepPlan, batch) -> PlanView:
    """`batch`: the InputBatch the plan was just applied to. The layout order is the cached
    requests' then the new ones' (StepPlan.check_layout, docs/invariants.md 7), so each
    column is read in place."""
    cached = plan.cached_reqs
    req_ids = plan.scheduled_req_ids
    num_new = np.array(plan.num_scheduled_tokens, np.int64)
    slots = batch.slots_of(req_ids)
    starts, known = planned_spans(plan)
    drafts = np.zeros(len(req_ids), np.int64)
    if cached.draft_entries:
        drafts[cached.draft_entries] = cached.num_drafts
    digest_len = known.copy()
    if cached.self_drafted:
        for i in cached.self_drafted:
            slot = int(slots[i])
            nd = int(batch.num_draft_tokens[slot])
            if 1 + nd > num_new[i]:
                raise AssertionError(f"request {req_ids[i]!r}: {nd} drafts but {num_new[i]} "
                                     "tokens planned")
            num_new[i] = 1 + nd
            landed = int(batch.num_tokens_known[slot])
            starts[i] = batch.num_computed_tokens[slot]
            known[i] = landed + int(batch.num_pending_samples[slot])
            drafts[i] = nd
            digest_len[i] = landed
    return PlanView(req_ids, slots, starts, num_new, known, drafts, digest_len, plan.prefill_shaped)
