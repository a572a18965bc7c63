"""The inputs of a decode step that replays a graph (stages/cuda_graphs.py), staged straight
into the buffer the graph reads: one host pack, one host-to-device copy, nothing else.

A decode step of n requests replays the graph of the smallest captured size b >= n. The
graph reads fixed segments of one int64 device buffer, `capacity` (the largest size) long
each; this step writes their first b entries, the rows past n as padding:

  positions     each row's one token's position               padding 0
  slots         where its KV lands (block * block_size + offset)  the scratch block's slot
  ctx           its context length after the step (position + 1)  1
  rows          its batch slot: the graph gathers its block table  the pad row (all scratch
                from the device mirror and reads its fed sample     blocks; its fed entry is
                by it                                               never read)
  ids           first rank: its input id (0 where fed)         0
  fed           first rank: 1 where the id is the slot's latest fed sample (patched in the
                graph from the device buffer of samples)       0

then, read outside the graph, variable-sized: the sampled slots (at most `capacity`), and
the block table rows that changed since the last step (DeviceBlockTable; at most the batch's
`table_rows`, since they are the whole batch's), scattered into the mirror before the
replay. Only the used extent is copied.

Host buffers: a HostRing of `depth` pinned buffers (stages/staging.py: one is rewritten only
once its last copy is done, docs/invariants.md 2). The device buffer needs no such care: the
next copy is queued on the same stream, after the replay that reads it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stages.staging import HostRing

SEGMENTS = ("positions", "slots", "ctx", "rows", "ids", "fed")


@dataclass
class StagedDecode:
    """One decode step's inputs, staged: the graph size it replays and the device views the
    runner reads outside the graph."""

    n: int  # requests
    b: int  # the graph's size (>= n)
    sample_slots: torch.Tensor  # [num_sampled] device
    num_dirty: int  # block table rows to scatter into the mirror before the replay
    dirty_slots: torch.Tensor
    dirty_rows: torch.Tensor


class GraphInputs:
    def __init__(self, capacity: int, table_width: int, *, table_rows: int, scratch_slot: int,
                 pad_row: int, device: str, depth: int = 2, has_ids: bool = True) -> None:
        """capacity: the largest graph's rows; table_rows: the batch's slots (the mirror's
        rows), what the changed block-table rows are bounded by: they are the whole batch's
        (removals and appends of requests outside this step too, at PP>1 another lane's),
        not only this step's rows. has_ids: the first rank's graph reads input ids and fed
        flags."""
        self.capacity, self.width, self.table_rows = capacity, table_width, table_rows
        self.scratch_slot, self.pad_row, self.has_ids = scratch_slot, pad_row, has_ids
        self.is_cuda = device == "cuda"
        C, R = capacity, table_rows
        self._tail = len(SEGMENTS) * C  # where the sampled slots start
        # sampled slots (<= C), dirty slots (<= R), dirty rows (<= R x width)
        size = self._tail + C + R + R * table_width
        self.device_buffer = torch.zeros(size, dtype=torch.int64, device=device)
        self.views = {name: self.device_buffer[i * C:(i + 1) * C] for i, name in enumerate(SEGMENTS)}
        self._ring = HostRing(size, depth, cuda=self.is_cuda)

    def stage(self, b: int, positions: np.ndarray, slots: np.ndarray, rows: np.ndarray,
              ids: np.ndarray, fed: np.ndarray, sample_slots: np.ndarray,
              dirty_slots: np.ndarray, dirty_rows: np.ndarray) -> StagedDecode:
        """Pack and copy one step's inputs (n = len(rows) <= b <= capacity); ids and fed are
        empty off the first rank."""
        n, C, R = len(rows), self.capacity, self.table_rows
        if not 0 < n <= b <= C:
            raise ValueError(f"a staged decode step needs 0 < rows <= size <= {C}; got {n} "
                             f"rows for size {b}")
        if len(dirty_slots) > R:
            raise ValueError(f"{len(dirty_slots)} changed block-table rows; the batch has {R}")
        i = self._ring.take()
        h = self._ring.arrays[i]
        h[0:n] = positions
        h[n:b] = 0
        h[C:C + n] = slots
        h[C + n:C + b] = self.scratch_slot
        h[2 * C:2 * C + n] = positions + 1
        h[2 * C + n:2 * C + b] = 1
        h[3 * C:3 * C + n] = rows
        h[3 * C + n:3 * C + b] = self.pad_row
        if self.has_ids:
            h[4 * C:4 * C + n] = ids
            h[4 * C + n:4 * C + b] = 0
            h[5 * C:5 * C + n] = fed
            h[5 * C + n:5 * C + b] = 0
        k, d, t = len(sample_slots), len(dirty_slots), self._tail
        h[t:t + k] = sample_slots
        h[t + C:t + C + d] = dirty_slots
        rows_at = t + C + R
        end = rows_at + d * self.width
        h[rows_at:end] = dirty_rows.reshape(-1)
        used = end if d else t + C
        dev = self.device_buffer
        self._ring.copy_to(i, dev, used)
        return StagedDecode(n=n, b=b, sample_slots=dev[t:t + k], num_dirty=d,
                            dirty_slots=dev[t + C:t + C + d],
                            dirty_rows=dev[rows_at:end].view(d, self.width))
