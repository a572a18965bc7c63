"""The last rank -> rank 0 token link (stages/token_feedback.py) over a real gloo pair in one
process: tokens reach rank 0's device buffer in the plan's sample order and land in its rows
before the step is answered; another step's message is refused; a late value for a slot whose
tenant changed is dropped; and a wrong token on the link is caught where the driver's copy
meets it (a counted conflict, which the audit reports)."""
from __future__ import annotations

import threading
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ray_runtime.messages import NewRequestData
from ray_runtime.reconcile import audit
from ray_runtime.request import prefix_hash
from ray_runtime.sampling_params import SamplingParams
from ray_runtime.plan_record import Expectation
from stages.input_batch import InputBatch
from stages.token_feedback import FeedbackError, TokenReceiver, TokenSender
from stages.transport import connect_rendezvous, open_rendezvous


def gloo_pair(timeout_s: float = 5.0):
    master, port = open_rendezvous("127.0.0.1")
    stores = [master, connect_rendezvous("127.0.0.1", port)]
    groups = [None, None]

    def join(rank):
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("fb", stores[rank]), rank, 2,
                                             timedelta(seconds=timeout_s))

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(g is not None for g in groups)
    return groups


@pytest.fixture
def link():
    groups = gloo_pair()
    yield TokenReceiver(groups[0], "cpu", max_num_seqs=8), TokenSender(groups[1], "cpu")


def batch_with(prompts: dict[str, list[int]]) -> InputBatch:
    b = InputBatch(max_num_seqs=8, max_model_len=64, block_size=16)
    for i, (req_id, toks) in enumerate(prompts.items()):
        b.add(NewRequestData(req_id=req_id, incarnation=1, token_ids=toks,
                             num_prompt_tokens=len(toks), num_computed_tokens=0,
                             block_ids=[i], sampling=SamplingParams(max_tokens=8)))
    return b


def test_tokens_feed_the_device_buffer_and_land_in_step_order(link):
    receiver, sender = link
    b = batch_with({"a": [5, 6], "b": [7, 8, 9], "c": [3]})
    slots = np.array([b.req_id_to_slot[r] for r in ("c", "a")], np.int64)  # plan's sample order
    gens = b.expect_samples(slots)
    receiver.post(10, slots, gens)
    receiver.post(11, np.zeros(0, np.int64), gens[:0])  # a step that samples nothing: no message
    sender.send(10, torch.tensor([41, 42]))
    assert receiver.feed(slots[:1]) == 10  # a later step embeds c's pending sample, step 10's
    assert int(receiver.last_sampled[slots[0]]) == 41 and int(receiver.last_sampled[slots[1]]) == 42
    assert receiver.ready(10) and receiver.ready(11)
    receiver.land(10, b)
    assert b.token_ids[slots[0], 1] == 41 and b.token_ids[slots[1], 2] == 42
    assert b.num_pending_samples[slots].tolist() == [0, 0]
    assert b.num_tokens_known[slots].tolist() == [2, 3]
    b.check()
    assert receiver.num_posted() == 0


def test_another_steps_tokens_are_refused(link):
    receiver, sender = link
    b = batch_with({"a": [5, 6]})
    slots = np.array([0], np.int64)
    receiver.post(4, slots, b.expect_samples(slots))
    sender.send(5, torch.tensor([9]))  # out of step
    with pytest.raises(FeedbackError, match="expected step 4.*step 5"):
        receiver.land(4, b)


def test_a_late_value_for_a_new_tenant_is_dropped(link):
    receiver, sender = link
    b = batch_with({"a": [5, 6]})
    slots = np.array([0], np.int64)
    receiver.post(1, slots, b.expect_samples(slots))
    b.remove("a")
    b.add(NewRequestData(req_id="z", incarnation=1, token_ids=[1, 2, 3], num_prompt_tokens=3,
                         num_computed_tokens=0, block_ids=[0], sampling=SamplingParams()))
    sender.send(1, torch.tensor([77]))
    receiver.land(1, b)
    assert b.token_ids[0, :4].tolist() == [1, 2, 3, -1] and b.num_tokens_known[0] == 3
    b.check()


def test_a_wrong_token_on_the_link_is_reported_by_the_audit(link):
    """Planted bug: the link delivers 99 where the last rank sampled (and the driver
    committed) 42. Rank 0 lands 99; the driver's copy in the next plan disagrees, the row
    counts a conflict, and the audit names the request on rank 0."""
    receiver, sender = link
    b = batch_with({"a": [5, 6]})
    slots = np.array([0], np.int64)
    receiver.post(1, slots, b.expect_samples(slots))
    sender.send(1, torch.tensor([99]))
    receiver.land(1, b)
    b.write_tokens("a", 2, [42])  # the driver's canonical token
    tokens = [5, 6, 42]
    view_digest = b.digests_of(_view(b, "a", len(tokens)))
    exp = {"a": Expectation(1, len(tokens), prefix_hash(tokens), 0, 0)}
    found = audit(exp, view_digest, 0, True)
    assert found and found[0].req_id == "a" and found[0].rank == 0


def test_a_middle_rank_resolves_pending_samples_from_the_driver():
    """A rank between the first and the last never gets the value: the driver's token for a
    pending position resolves it (the array path and the single-request path alike)."""
    from ray_runtime.messages import CachedRequest, CachedRequestData

    b = batch_with({f"r{i}": [1, 2, 3] for i in range(8)})
    b.driver_resolves_pending = True
    slots = np.arange(8, dtype=np.int64)
    b.expect_samples(slots)
    b.mark_computed_rows(slots, np.full(8, 4))  # the placeholder step ran position 3
    b.update_many(CachedRequestData.of([CachedRequest(f"r{i}", 3, [50 + i], [], 4) for i in range(8)]))
    assert b.num_pending_samples.tolist() == [0] * 8
    assert b.token_ids[:, 3].tolist() == [50 + i for i in range(8)]
    b.check()
    b.expect_samples(slots[:1])
    b.update(CachedRequest("r0", 4, [60], [], 4))
    assert b.num_pending_samples[0] == 0 and b.num_tokens_known[0] == 5
    b.check()


def test_elsewhere_a_driver_token_over_a_pending_sample_is_a_bug():
    b = batch_with({"a": [5, 6]})
    b.expect_samples(np.array([0]))
    with pytest.raises(AssertionError, match="pending sample"):
        b.write_tokens("a", 2, [42])


def _view(b: InputBatch, req_id: str, known: int):
    from stages.plan_view import PlanView

    slot = b.req_id_to_slot[req_id]
    one = lambda v: np.array([v], np.int64)  # noqa: E731
    return PlanView([req_id], one(slot), one(known - 1), one(1), one(known), one(0), one(known))


def test_a_step_rank0_failed_keeps_the_link_aligned(link):
    """Rank 0 fails step 20 before it posts the step's receive; the last rank still sends
    the step's failure. Rank 0 receives and drops it (post_discard), so the last rank's next
    send does not wait for a receive that never comes, and step 21's tokens land. Without
    the discard the failure message would sit unreceived (a gloo send completes only once
    its receive is posted) and step 21's receive would get step 20's message."""
    receiver, sender = link
    b = batch_with({"a": [5, 6], "b": [7, 8, 9]})
    slots = np.array([b.req_id_to_slot[r] for r in ("a", "b")], np.int64)
    receiver.post_discard(20, 2)
    receiver.post_discard(20, 2)  # once per step
    assert receiver.num_posted() == 1
    sender.send_failure(20, 2)
    gens = b.expect_samples(slots)
    receiver.post(21, slots, gens)
    sent = threading.Thread(target=sender.send, args=(21, torch.tensor([50, 51])))
    sent.start()
    sent.join(3)
    assert not sent.is_alive(), "the last rank's send waited on step 20's"
    receiver.land(21, b)
    assert b.token_ids[slots[0], 2] == 50 and b.token_ids[slots[1], 3] == 51
    assert receiver.num_posted() == 0
    b.check()
