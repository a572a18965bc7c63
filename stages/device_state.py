"""Per-slot state the device keeps across steps: the mirror of the block table.

The host InputBatch.block_table is the source of truth. Rows written since the last step
(InputBatch.table_dirty: admissions, appended blocks, rollbacks, removals) travel in the
step's one staged copy and are scattered into this mirror before the step's kernels read it;
a step's tables are then a gather of its slots on the device, so an unchanged row never
crosses to the device again.
"""
from __future__ import annotations

import numpy as np
import torch


class DeviceBlockTable:
    def __init__(self, batch, device: str) -> None:
        self.batch = batch
        # one row more than the batch's: the pad row that a decode graph's padding rows read
        # (stages/cuda_graphs.py fills it with the scratch block)
        rows, width = batch.block_table.shape
        self.table = torch.zeros((rows + 1, width), dtype=torch.int64, device=device)
        self._dirty = np.zeros(0, np.int64)

    def changes(self) -> list[np.ndarray]:
        """The host arrays to stage with this step: the dirty slots and their rows."""
        self._dirty = np.nonzero(self.batch.table_dirty)[0]
        return [self._dirty, self.batch.block_table[self._dirty]]

    def apply(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Scatter the staged rows (queued on the stream before the step's kernels)."""
        if len(self._dirty):  # a host-known size: no device sync
            self.table[slots] = rows
        self.batch.table_dirty[self._dirty] = False

    def gather(self, slots: torch.Tensor, max_blocks: int) -> torch.Tensor:
        """[len(slots), max_blocks]: the step's block tables (rows read with their stride)."""
        return self.table.index_select(0, slots)[:, :max_blocks]

    def check(self) -> None:
        """The mirror equals the host table on every live slot (syncs: tests, debug)."""
        live = np.array(sorted(self.batch.req_id_to_slot.values()), np.int64)
        dirty = self.batch.table_dirty[live]
        live = live[~dirty]  # rows not shipped yet are allowed to differ
        mirror = self.table[torch.from_numpy(live).to(self.table.device)].cpu().numpy()
        assert (mirror == self.batch.block_table[live]).all(), "device block table drifted"
