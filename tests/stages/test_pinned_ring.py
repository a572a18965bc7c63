"""The host-copy ring (stages/pinned_ring.py): with a ring of k buffers, the k most recent
buffers handed out are distinct memory, so a copy is never written over one that a step
still in flight has not read (invariant 2). The last rank sizes its ring one past the step
loop's limit (two alternating buffers were overwritten once 2 x PP steps were in flight)."""
import pytest
import torch

from stages.pinned_ring import PinnedRing


@pytest.mark.parametrize("k", [2, 3, 9])
def test_the_last_k_buffers_never_share_memory(k):
    ring = PinnedRing(k, 16, torch.long, pin=False)
    held = []  # (buffer, the value written into it): the copies not yet read
    for step in range(5 * k):
        buf = ring.next(1 + step % 16)
        buf.fill_(step)
        held.append((buf, step))
        held = held[-k:]  # k outstanding at most
        for b, value in held:
            assert bool((b == value).all()), f"step {step}: a held copy was overwritten"
    assert len(ring) == k


def test_a_ring_of_one_is_refused():
    with pytest.raises(ValueError, match="at least 2"):
        PinnedRing(1, 4, torch.long, pin=False)

