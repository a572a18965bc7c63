"""The step-tagged link between two stages (stages/transport.py), over real gloo groups in one
process: a transfer of another step, or of another shape, is refused with an error naming both
steps and both ranks, without aborting the process and without knocking the link out of
step; a failure header fails the receiver at once; rank 0's rendezvous store listens on the
address it was given, not on every interface."""
from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from stages.transport import (LinkError, StageTransport, StepMismatch, UpstreamFailed,
                              connect_rendezvous, open_rendezvous)

HIDDEN = 8  # float32: 32-byte rows, the header's size
INLINE = 4  # rows a step's message carries inline in these tests; more travel apart


def listening_addresses(port: int) -> list[str]:
    """The local addresses of this host's listening TCP sockets on `port` (/proc/net, where
    each 32-bit word of an address is printed in little-endian order)."""
    found = []
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr_hex, port_hex = fields[1].split(":")
            if fields[3] == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(addr_hex)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.append(socket.inet_ntop(family, raw))
    return found


def make_pair(timeout_s: float, inline_rows: int) -> list[StageTransport]:
    """(rank 0's transport, rank 1's) over a fresh rendezvous on 127.0.0.1. inline_rows=0:
    every step's activations travel apart from its header, as on GPU (here over gloo)."""
    master, port = open_rendezvous("127.0.0.1")
    stores = [master, connect_rendezvous("127.0.0.1", port)]
    groups = [None, None]

    def join(rank):
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("t", stores[rank]), rank, 2,
                                             timedelta(seconds=timeout_s))

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(g is not None for g in groups), "the gloo group did not form"
    return [StageTransport(r, 2, "cpu", groups[r], HIDDEN, torch.float32,
                           inline_bytes=inline_rows * HIDDEN * 4) for r in range(2)]


@pytest.fixture(params=[INLINE, 0], ids=["cpu", "gpu_format"])
def link(request):
    pair = make_pair(timeout_s=5.0, inline_rows=request.param)
    yield pair
    for t in pair:
        t.close()


def acts(step: int, num_tokens: int) -> torch.Tensor:
    return torch.full((num_tokens, HIDDEN), float(step)) + torch.arange(num_tokens)[:, None]


def test_tagged_transfers_arrive_in_order(link):
    """Inline (up to INLINE rows) and apart from the header (more), mixed."""
    sender, receiver = link
    for step, n in ((3, 5), (4, 1), (5, INLINE), (6, 9), (7, 2)):
        sender.send_to_next(step, acts(step, n))
        got = receiver.recv_from_prev(step, n)
        assert torch.equal(got, acts(step, n))
    sender.wait_sends()


def test_another_steps_activations_are_refused(link):
    sender, receiver = link
    sender.send_to_next(6, acts(6, 4))  # a step the receiver never took (it failed it)
    with pytest.raises(StepMismatch) as err:
        receiver.recv_from_prev(7, 3)
    msg = str(err.value)
    assert "rank 1 expected step 7" in msg and "rank 0 sent step 6" in msg, msg
    # The stale payload was received whole: the link is aligned, the next step goes through.
    sender.send_to_next(7, acts(7, 3))
    assert torch.equal(receiver.recv_from_prev(7, 3), acts(7, 3))


def test_another_shape_is_refused_not_aborted(link):
    """gloo aborts the whole process when a receive's size differs from the send's; the
    header lets the receiver take the sent shape and refuse it instead."""
    sender, receiver = link
    sender.send_to_next(9, acts(9, 6))
    with pytest.raises(StepMismatch, match=r"expected step 9's activations \(2 tokens x 8\).*"
                                           r"sent step 9's \(6 tokens x 8\)"):
        receiver.recv_from_prev(9, 2)
    sender.send_to_next(10, acts(10, 2))
    assert torch.equal(receiver.recv_from_prev(10, 2), acts(10, 2))


def test_a_failed_step_fails_the_next_rank_at_once(link):
    sender, receiver = link
    sender.send_failure(11)
    with pytest.raises(UpstreamFailed, match="rank 1: rank 0 failed step 11"):
        receiver.recv_from_prev(11, 2)
    # A step whose activations already left sends no failure header after them.
    sender.send_to_next(12, acts(12, 2))
    sender.send_failure(12)
    assert torch.equal(receiver.recv_from_prev(12, 2), acts(12, 2))
    sender.send_to_next(13, acts(13, 1))
    assert torch.equal(receiver.recv_from_prev(13, 1), acts(13, 1))


def test_a_refused_large_step_leaves_the_link_aligned(link):
    """A stale step whose activations travelled apart from its header is received whole
    before it is refused: the next step's header is the next message."""
    sender, receiver = link
    sender.send_to_next(20, acts(20, 9))
    with pytest.raises(StepMismatch, match="expected step 21's .* sent step 20's"):
        receiver.recv_from_prev(21, 2)
    sender.send_to_next(21, acts(21, 2))
    assert torch.equal(receiver.recv_from_prev(21, 2), acts(21, 2))


def test_wrong_width_is_refused_before_sending(link):
    sender, _ = link
    with pytest.raises(LinkError, match="step 14's activations have 9 columns; the link "
                                        "carries 8"):
        sender.send_to_next(14, torch.zeros(2, HIDDEN + 1))


def test_a_silent_neighbour_times_out_within_the_group_timeout():
    _, receiver = make_pair(timeout_s=1.0, inline_rows=INLINE)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="[Tt]imed out"):
        receiver.recv_from_prev(1, 2)
    assert time.monotonic() - t0 < 5.0


def test_rendezvous_store_listens_on_the_given_address_only():
    store, port = open_rendezvous("127.0.0.1")
    assert store.port == port
    assert listening_addresses(port) == ["127.0.0.1"], listening_addresses(port)
    client = connect_rendezvous("127.0.0.1", port)
    client.set("k", "v")
    assert store.get("k") == b"v"


def test_a_step_failed_before_its_receive_still_takes_its_message(link):
    """The receiver fails step 3 before it reads the step's activations (its plan did not
    apply): discard_from_prev takes and drops them, so step 4 gets its own (no StepMismatch)
    and the sender's next sends never wait on a receive that does not come. Taking a message
    once per step: a step refused on receipt is not taken again."""
    sender, receiver = link
    sender.send_to_next(3, acts(3, 6))
    receiver.discard_from_prev(3)
    sender.send_to_next(4, acts(4, 2))  # waits for step 3's sends: they were received
    assert torch.equal(receiver.recv_from_prev(4, 2), acts(4, 2))
    sender.send_to_next(5, acts(5, 7))
    with pytest.raises(StepMismatch):
        receiver.recv_from_prev(6, 7)  # step 5's message, taken on step 6's behalf
    receiver.discard_from_prev(6)  # already took one: nothing more
    sender.send_to_next(7, acts(7, 1))
    assert torch.equal(receiver.recv_from_prev(7, 1), acts(7, 1))
