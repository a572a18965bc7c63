"""The per-request parts of a plan and of a step's reply, as columns (vLLM's CachedRequestData
shape): one list per field, entry i of each belonging to req_ids[i], instead of a struct per
request. A rank decodes a step into a few lists and reads them as numpy arrays, with no Python
work per request on a decode step; the driver builds them with a few appends per request.

Fields every entry has are dense (one value per request). Fields few entries have (new KV
blocks: one step in block_size; drafts: speculative decoding only; self-drafting) are sparse:
the list of entries that have them, then their values. Variable-length values (tokens, block
ids, drafts) are flattened: entry i's are the next count[i] of the flat list.

Records (CachedRequest, RowDigest) are one entry as a frozen struct: what update() of one row
takes, what tests build plans from; cached[i] and iter(cached) give them.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Optional

import msgspec


def _index(i: int, n: int) -> int:
    """i as a list index reads it (negative from the end), or IndexError."""
    j = i + n if i < 0 else i
    if not 0 <= j < n:
        raise IndexError(f"index {i} out of range for {n} requests")
    return j


class _Entries:
    """A columns struct read as a sequence of its records (`records(which)` and `req_ids`)."""

    __slots__ = ()

    def __len__(self) -> int:
        return len(self.req_ids)

    def __iter__(self):
        return iter(self.records())

    def __getitem__(self, i):
        return self.records()[i] if isinstance(i, slice) else self.records([_index(i, len(self))])[0]


class CachedRequest(msgspec.Struct, frozen=True, gc=False):
    """One entry of a CachedRequestData, as a record. Not sent as such: plans carry columns."""

    req_id: str
    token_start: int  # position of new_token_ids[0] in the request's token sequence
    new_token_ids: list[int]  # tokens [token_start, token_start + len) of the driver's view
    new_block_ids: list[int]
    num_computed_tokens: int  # the driver's count before this step, checked by every rank
    # Index of new_block_ids[0] in the row's block table (a rollback shrinks it); None: append.
    block_start: Optional[int] = None
    # Speculative decoding: the drafts this step verifies, placed right after the known
    # prefix. Every plan naming a request states its drafts (none: an empty list).
    draft_token_ids: list[int] = []
    # PP=1 async: the rank runs its own latest tokens and drafts (1 + its drafts, at most
    # num_scheduled_tokens) from its own computed count; the driver corrects its view later.
    self_drafted: bool = False


class CachedRequestData(msgspec.Struct, _Entries, array_like=True, gc=False):
    """The requests already in the ranks' batches: only what changed since the last plan
    naming each (see the module docstring for the layout)."""

    # dense: one per request
    req_ids: list[str] = []
    token_starts: list[int] = []
    num_new_tokens: list[int] = []
    new_token_ids: list[int] = []  # flat
    num_computed_tokens: list[int] = []
    block_starts: list[int] = []  # where this step's blocks start in the row; -1: append
    # sparse: the entries (ascending indices into req_ids) that have them
    block_entries: list[int] = []  # entries given new blocks
    num_new_blocks: list[int] = []  # per block entry
    new_block_ids: list[int] = []  # flat
    draft_entries: list[int] = []  # entries with drafts to verify
    num_drafts: list[int] = []  # per draft entry
    draft_token_ids: list[int] = []  # flat
    self_drafted: list[int] = []  # entries planned self-drafted

    @classmethod
    def of(cls, entries) -> "CachedRequestData":
        out = cls()
        for e in entries:
            out.append(e.req_id, e.token_start, e.new_token_ids, e.new_block_ids,
                       e.num_computed_tokens, e.block_start, e.draft_token_ids, e.self_drafted)
        return out

    def append(self, req_id: str, token_start: int, new_token_ids: list[int],
               new_block_ids: list[int], num_computed_tokens: int, block_start: Optional[int],
               draft_token_ids: list[int], self_drafted: bool) -> None:
        """One more request, from a record's fields (the scheduler appends the dense columns
        itself and calls add_rare)."""
        i = len(self.req_ids)
        self.req_ids.append(req_id)
        self.token_starts.append(token_start)
        self.num_new_tokens.append(len(new_token_ids))
        self.new_token_ids.extend(new_token_ids)
        self.num_computed_tokens.append(num_computed_tokens)
        self.block_starts.append(-1 if block_start is None else block_start)
        if new_block_ids or draft_token_ids or self_drafted:
            self.add_rare(i, new_block_ids, draft_token_ids, self_drafted)

    def add_rare(self, i: int, new_block_ids: list[int], draft_token_ids: list[int],
                 self_drafted: bool) -> None:
        """Entry i's sparse fields (entries in ascending order)."""
        if new_block_ids:
            self.block_entries.append(i)
            self.num_new_blocks.append(len(new_block_ids))
            self.new_block_ids.extend(new_block_ids)
        if draft_token_ids:
            self.draft_entries.append(i)
            self.num_drafts.append(len(draft_token_ids))
            self.draft_token_ids.extend(draft_token_ids)
        if self_drafted:
            self.self_drafted.append(i)

    def records(self, which=None) -> list[CachedRequest]:
        """Entries `which` (indices; all by default) as records."""
        tok = list(accumulate(self.num_new_tokens, initial=0))
        blocks = _sparse(self.block_entries, self.num_new_blocks, self.new_block_ids)
        drafts = _sparse(self.draft_entries, self.num_drafts, self.draft_token_ids)
        selfd = set(self.self_drafted)
        out = []
        for i in (range(len(self.req_ids)) if which is None else which):
            start = self.block_starts[i]
            out.append(CachedRequest(
                self.req_ids[i], self.token_starts[i], self.new_token_ids[tok[i]:tok[i + 1]],
                blocks.get(i, []), self.num_computed_tokens[i], None if start < 0 else start,
                drafts.get(i, []), i in selfd))
        return out

    def check(self) -> None:
        """Every dense column has one entry per request, every sparse one per listed entry;
        entries ascend within range; counts are positive and sum to their flat list."""
        n = len(self.req_ids)
        for name in ("token_starts", "num_new_tokens", "num_computed_tokens", "block_starts"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"CachedRequestData.{name}: {len(getattr(self, name))} "
                                 f"entries for {n} requests")
        if n and min(self.num_new_tokens) < 0:
            raise ValueError("CachedRequestData.num_new_tokens: a negative count")
        if n and min(self.block_starts) < -1:
            raise ValueError("CachedRequestData.block_starts: below -1 (-1: append)")
        if len(self.new_token_ids) != sum(self.num_new_tokens):
            raise ValueError(f"CachedRequestData.new_token_ids: {len(self.new_token_ids)} "
                             f"entries, num_new_tokens sums to {sum(self.num_new_tokens)}")
        for entries, counts, flat in (("block_entries", "num_new_blocks", "new_block_ids"),
                                      ("draft_entries", "num_drafts", "draft_token_ids"),
                                      ("self_drafted", None, None)):
            e = getattr(self, entries)
            if any(not 0 <= a < n for a in e) or any(a >= b for a, b in zip(e, e[1:])):
                raise ValueError(f"CachedRequestData.{entries}: not ascending entries of {n}")
            if counts is None:
                continue
            c, f = getattr(self, counts), getattr(self, flat)
            if len(c) != len(e) or any(x <= 0 for x in c) or sum(c) != len(f):
                raise ValueError(f"CachedRequestData.{counts}: {c} for {entries} {e} and "
                                 f"{len(f)} {flat}")


def _sparse(entries: list[int], counts: list[int], flat: list[int]) -> dict[int, list[int]]:
    offsets = list(accumulate(counts, initial=0))
    return {e: flat[offsets[j]:offsets[j + 1]] for j, e in enumerate(entries)}


class RowDigest(msgspec.Struct, frozen=True, gc=False):
    """One rank's bookkeeping for one request, right after it applied a plan, over the
    prefix the driver has told it about (see ray_runtime/digest.py): one entry of a
    RowDigests, as a record."""

    req_id: str
    incarnation: int
    num_tokens_known: int  # the row's own counter
    hash_length: int  # the driver's count of known tokens, as the plan stated it
    num_computed_tokens: int
    token_hash: int  # over token_ids[:hash_length + num_draft_tokens] as the row holds them
    num_conflicts: int  # driver tokens that disagreed with what the row already held
    num_draft_tokens: int = 0  # drafts the row holds after the known prefix


class RowDigests(msgspec.Struct, _Entries, array_like=True, gc=False):
    """One rank's digests of the requests a step ran, as columns: entry i of every list is
    req_ids[i]'s (the fields of RowDigest). Entry i as a record: digests[i]."""

    req_ids: list[str] = []
    incarnation: list[int] = []
    num_tokens_known: list[int] = []
    hash_length: list[int] = []
    num_computed_tokens: list[int] = []
    token_hash: list[int] = []
    num_conflicts: list[int] = []
    num_draft_tokens: list[int] = []

    @classmethod
    def of(cls, records) -> "RowDigests":
        cols = list(zip(*(msgspec.structs.astuple(r) for r in records)))
        return cls(*(list(c) for c in cols)) if cols else cls()

    def check(self) -> None:
        """One entry per request in every column (the audit reads them side by side)."""
        n = len(self.req_ids)
        for name, column in zip(self.__struct_fields__, msgspec.structs.astuple(self)):
            if len(column) != n:
                raise ValueError(f"RowDigests.{name}: {len(column)} entries for {n} requests")

    def records(self, which=None) -> list[RowDigest]:
        """Entries `which` (indices; all by default) as records."""
        cols = msgspec.structs.astuple(self)
        idx = range(len(self.req_ids)) if which is None else which
        return [RowDigest(*(c[i] for c in cols)) for i in idx]
