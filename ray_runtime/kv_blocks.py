"""KV block accounting: the one owner of which pool block belongs to which request.

Every stage holds a pool of the same `num_blocks` blocks for its own layers, so one
allocation here is valid on every rank. Check-then-commit: `can_allocate` changes nothing,
`allocate` asserts and mutates.
"""
from __future__ import annotations

from collections import deque
from typing import Optional


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._owned: dict[str, list[int]] = {}
        # owned_of(req_id): the list of blocks req_id owns, or None; read-only for callers
        # (the scheduler's per-request fast path: no call of ours around a dict lookup).
        self.owned_of = self._owned.get

    def blocks_needed(self, req_id: str, num_tokens: int) -> int:
        have = len(self._owned.get(req_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, req_id: str, num_tokens: int) -> bool:
        return self.blocks_needed(req_id, num_tokens) <= len(self._free)

    def allocate(self, req_id: str, num_tokens: int) -> list[int]:
        """Grow req_id's blocks to hold num_tokens tokens; returns only the new block ids."""
        n = self.blocks_needed(req_id, num_tokens)
        assert n <= len(self._free), f"allocate({req_id}, {num_tokens}) without can_allocate"
        new = [self._free.popleft() for _ in range(n)]
        self._owned.setdefault(req_id, []).extend(new)
        return new

    def reserve(self, req_id: str, num_tokens: int) -> Optional[tuple[int, list[int]]]:
        """can_allocate, num_owned and allocate in one lookup (the scheduler's per-request
        path): (blocks req_id owned before, the new block ids), or None when the pool lacks
        them (then nothing changes)."""
        owned = self._owned.get(req_id)
        have = 0 if owned is None else len(owned)
        n = -(-num_tokens // self.block_size) - have
        if n <= 0:
            if owned is None:
                self._owned[req_id] = []
            return have, []
        free = self._free
        if n > len(free):
            return None
        new = [free.popleft() for _ in range(n)]
        if owned is None:
            self._owned[req_id] = new[:]
        else:
            owned.extend(new)
        return have, new

    def num_owned(self, req_id: str) -> int:
        return len(self._owned.get(req_id, ()))

    def trim(self, req_id: str, num_tokens: int) -> int:
        """Give back the blocks past what num_tokens tokens need (rejected drafts' slots);
        returns how many were freed."""
        owned = self._owned.get(req_id, [])
        keep = -(-num_tokens // self.block_size)
        surplus = owned[keep:]
        del owned[keep:]
        self._free.extend(surplus)
        return len(surplus)

    def block_ids(self, req_id: str) -> list[int]:
        return list(self._owned.get(req_id, ()))

    def free(self, req_id: str) -> None:
        self._free.extend(self._owned.pop(req_id, ()))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def check(self) -> None:
        owned = [b for blocks in self._owned.values() for b in blocks]
        every = owned + list(self._free)
        assert len(every) == self.num_blocks and set(every) == set(range(self.num_blocks)), \
            "block pool leak or double ownership: free + owned != all blocks"
