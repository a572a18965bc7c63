"""The step-tagged link between two stages (stages/transport.py), over real gloo groups in one
process: a transfer of another step, or of another shape, is refused with an error naming both
steps and both ranks, without aborting the process and without knocking the link out of
step; a failure header fails the receiver at once; rank 0's rendezvous store listens on the
address it was given, not on every interface."""
from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from stages.transport import (StageTransport, StepMismatch, UpstreamFailed, connect_rendezvous,
                              open_rendezvous)

HIDDEN = 8


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


@pytest.fixture
def link():
    """(rank 0's transport, rank 1's) over a fresh rendezvous on 127.0.0.1, 3 s timeout."""
    master, port = open_rendezvous("127.0.0.1")
    stores = [master, connect_rendezvous("127.0.0.1", port)]
    groups = [None, None]

    def join(rank):
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("t", stores[rank]), rank, 2,
                                             timedelta(seconds=3))

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(g is not None for g in groups), "the gloo group did not form"
    pair = [StageTransport(r, 2, "cpu", groups[r]) for r in range(2)]
    yield pair
    for t in pair:
        t.close()


def acts(step: int, num_tokens: int) -> torch.Tensor:
    return torch.full((num_tokens, HIDDEN), float(step)) + torch.arange(num_tokens)[:, None]


def test_tagged_transfers_arrive_in_order(link):
    sender, receiver = link
    for step, n in ((3, 5), (4, 1), (5, 7)):
        sender.send_to_next(step, acts(step, n))
        got = receiver.recv_from_prev(step, n, HIDDEN, torch.float32)
        assert torch.equal(got, acts(step, n))
    sender.wait_sends()


def test_another_steps_activations_are_refused(link):
    sender, receiver = link
    sender.send_to_next(6, acts(6, 4))  # a step the receiver never took (it failed it)
    with pytest.raises(StepMismatch) as err:
        receiver.recv_from_prev(7, 3, HIDDEN, torch.float32)
    msg = str(err.value)
    assert "rank 1 expected step 7" in msg and "rank 0 sent step 6" in msg, msg
    # The stale payload was received whole: the link is aligned, the next step goes through.
    sender.send_to_next(7, acts(7, 3))
    assert torch.equal(receiver.recv_from_prev(7, 3, HIDDEN, torch.float32), acts(7, 3))


def test_another_shape_is_refused_not_aborted(link):
    """gloo aborts the whole process when a receive's size differs from the send's; the
    header lets the receiver take the sent shape and refuse it instead."""
    sender, receiver = link
    sender.send_to_next(9, acts(9, 6))
    with pytest.raises(StepMismatch, match=r"expected step 9's activations \(2 tokens x 8\).*"
                                           r"sent step 9's \(6 tokens x 8\)"):
        receiver.recv_from_prev(9, 2, HIDDEN, torch.float32)
    sender.send_to_next(10, acts(10, 2))
    assert torch.equal(receiver.recv_from_prev(10, 2, HIDDEN, torch.float32), acts(10, 2))


def test_a_failed_step_fails_the_next_rank_at_once(link):
    sender, receiver = link
    sender.send_failure(11)
    with pytest.raises(UpstreamFailed, match="rank 1: rank 0 failed step 11"):
        receiver.recv_from_prev(11, 2, HIDDEN, torch.float32)
    # A step whose activations already left sends no failure header after them.
    sender.send_to_next(12, acts(12, 2))
    sender.send_failure(12)
    assert torch.equal(receiver.recv_from_prev(12, 2, HIDDEN, torch.float32), acts(12, 2))
    sender.send_to_next(13, acts(13, 1))
    assert torch.equal(receiver.recv_from_prev(13, 1, HIDDEN, torch.float32), acts(13, 1))


def test_a_silent_neighbour_times_out_within_the_group_timeout(link):
    _, receiver = link
    with pytest.raises(RuntimeError, match="[Tt]imed out"):
        receiver.recv_from_prev(1, 2, HIDDEN, torch.float32)


def test_rendezvous_store_listens_on_the_given_address_only():
    store, port = open_rendezvous("127.0.0.1")
    assert store.port == port
    assert listening_addresses(port) == ["127.0.0.1"], listening_addresses(port)
    client = connect_rendezvous("127.0.0.1", port)
    client.set("k", "v")
    assert store.get("k") == b"v"
