"""A step's host-to-device inputs in one copy: every int64 array the step needs (positions,
slot mapping, block tables, decode layout, input ids, sample indices) is packed into one
pinned host buffer and copied to one device buffer with a single non-blocking copy.

Why: a copy from pageable memory makes the host wait for the device's queue to drain, which
would serialize the next step's staging behind the running step. A ring of `depth` pinned
buffers takes turns; before one is rewritten, the event recorded after its last copy is
waited on, so a copy still in flight is never overwritten (docs/invariants.md, 2). The runner
makes the ring one longer than the steps it keeps in flight, so that this wait never holds
the host closer to its device than the step loop's own limit does. The device buffer needs no
such care: the next copy is queued on the same stream, after the kernels that read it.
"""
from __future__ import annotations

import numpy as np
import torch

from stages.profiling import phase


def to_device_async(array: np.ndarray, device) -> torch.Tensor:
    """A small host array on `device` without making the host wait: for CUDA through pinned
    memory and a non-blocking copy (the caching host allocator keeps the pinned buffer until
    the copy is done); for the CPU the array itself, shared."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def packed_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Where each of the arrays (int64 element counts) starts in the staging buffer, and the
    elements used. Each starts on a 16-byte boundary (an even offset): Triton specializes a
    kernel on its pointers' alignment, so views at drifting offsets would compile a variant
    per alignment pattern in the middle of a run."""
    offsets, off = [], 0
    for n in sizes:
        offsets.append(off)
        off += n + (n & 1)
    return offsets, off


def pack(arrays: list[np.ndarray], offsets: list[int], host: np.ndarray) -> None:
    for a, o in zip(arrays, offsets):
        host[o:o + a.size] = a.reshape(-1)


def unpack(buffer, arrays: list[np.ndarray], offsets: list[int]) -> list:
    """Views of `buffer` (the device copy of the packed host buffer) shaped as the arrays."""
    return [buffer[o:o + a.size].view(a.shape) for o, a in zip(offsets, arrays)]


class HostRing:
    """`depth` int64 host buffers of `size`, pinned on CUDA, taken in turn for host-to-device
    copies: a buffer is handed out again only once the copy made from it is done (the event
    recorded after it is waited on), so a copy in flight is never overwritten
    (docs/invariants.md, 2). Serves InputStaging and a graph's GraphInputs."""

    def __init__(self, size: int, depth: int, cuda: bool) -> None:
        self.check_depth(depth)
        self.cuda = cuda
        self.buffers = [torch.zeros(size, dtype=torch.int64, pin_memory=cuda)
                        for _ in range(depth)]
        self.arrays = [b.numpy() for b in self.buffers]  # the same memory, for packing
        self._copied = [None] * depth  # the event after each buffer's last copy (CUDA)
        self._turn = 0

    @staticmethod
    def check_depth(depth: int) -> None:
        if depth < 2:
            raise ValueError(f"depth: a staging ring needs at least 2 buffers, got {depth}")

    def take(self) -> int:
        """The next buffer's index, free to rewrite."""
        i = self._turn
        self._turn = (i + 1) % len(self.buffers)
        if self._copied[i] is not None:
            with phase("staging wait"):
                self._copied[i].synchronize()  # normally long done: `depth` steps ago
        return i

    def copy_to(self, i: int, device_buffer: torch.Tensor, used: int) -> None:
        """The first `used` entries of buffer i into device_buffer (non-blocking on CUDA)."""
        device_buffer[:used].copy_(self.buffers[i][:used], non_blocking=self.cuda)
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record()
            self._copied[i] = ev


class InputStaging:
    def __init__(self, device: str, capacity: int = 1 << 16, depth: int = 2) -> None:
        HostRing.check_depth(depth)
        self.device = device
        self.depth = depth
        self.is_cuda = device == "cuda"
        self._capacity = 0
        if self.is_cuda:
            self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        # Old buffers stay alive while an in-flight copy holds them (torch's caching host
        # allocator records the copy's stream), so replacing them here is safe.
        self._capacity = capacity
        self._ring = HostRing(capacity, self.depth, cuda=True)
        self._dev = torch.empty(capacity, dtype=torch.int64, device=self.device)

    def __call__(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Device int64 tensors with the arrays' shapes and values."""
        if not self.is_cuda:
            return [torch.from_numpy(np.ascontiguousarray(a, np.int64)) for a in arrays]
        offsets, total = packed_offsets([a.size for a in arrays])
        if total > self._capacity:
            self._grow(max(total, 2 * self._capacity))
        i = self._ring.take()
        pack(arrays, offsets, self._ring.arrays[i])
        self._ring.copy_to(i, self._dev, total)
        return unpack(self._dev, arrays, offsets)
