"""Host buffers for device-to-host copies that are read a few steps later: a ring, one
buffer per step that may still be unread, so a copy is never written into a buffer whose
previous copy has not been read yet (docs/invariants.md, 2). Pinned on CUDA, so the copy is
asynchronous."""
from __future__ import annotations

import torch


class PinnedRing:
    def __init__(self, num_buffers: int, size: int, dtype: torch.dtype, pin: bool) -> None:
        """num_buffers: more than the copies that can be outstanding (written, not yet read)
        at once; size: each buffer's length."""
        if num_buffers < 2:
            raise ValueError(f"a ring needs at least 2 buffers, got {num_buffers}")
        self._buffers = [torch.zeros(size, dtype=dtype, pin_memory=pin) for _ in range(num_buffers)]
        self._at = 0

    def next(self, n: int) -> torch.Tensor:
        """The first n elements of the next buffer (the one least recently handed out)."""
        self._at = (self._at + 1) % len(self._buffers)
        return self._buffers[self._at][:n]

    def __len__(self) -> int:
        return len(self._buffers)
