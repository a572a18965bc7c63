"""The rank-local request state in stable slots: a request holds one slot (a row of every
per-request array) from admission to removal; nothing is ever condensed or moved, and each
step's batch is a view over slots (the runner's `rows`, batch index -> slot).

The host arrays here are the source of truth; device copies (the runner's input staging,
the sampler's last tokens) are refreshed from them or written by the device and folded back
here when the step's result lands.

Invariants (docs/invariants.md, 1 and 3), enforced by `check()`:
  - a slot holds its complete known prefix token_ids[slot, :num_tokens_known]: the prompt
    plus every committed output token; then its num_draft_tokens speculative drafts;
    positions past those hold POISON, never stale tokens;
  - num_computed_tokens <= num_tokens_known, and num_tokens_known >= num_prompt_tokens;
  - num_tokens_known only grows, from its own value (see `append_tokens`), never from
    num_computed_tokens;
  - adding a request initializes every per-slot field and bumps the slot's generation, so
    a late result for the slot's previous tenant is recognised and dropped;
  - free slots and live slots partition [0, max_num_seqs).
Requests are addressed by id; slot indices never leave this rank.
"""
from __future__ import annotations

import heapq
from operator import itemgetter
from typing import Optional

import numpy as np

from ray_runtime.digest import rows_hash, spans_hash_delta
from ray_runtime.messages import (CachedRequest, CachedRequestData, NewRequestData, RowDigests,
                                  StepPlan)
from ray_runtime.sampling_params import SamplingParams
from stages.plan_view import PlanView, plan_view

POISON = -1  # token id stored past a row's known prefix; embedding it fails loudly


class InputBatch:
    array_path_min = 8  # update_many: below this many cached requests, a loop is faster
    # Per-slot numpy fields other than token_ids and block_table; `_clear_row` resets them all.
    _ROW_SCALARS = ("num_tokens_known", "num_prompt_tokens", "num_computed_tokens",
                    "num_blocks", "incarnation", "last_sampled_token", "num_conflicts",
                    "num_draft_tokens", "num_unresolved_drafts", "num_draft_computed",
                    "num_pending_samples", "hash_len", "hash_val", "num_digests",
                    "greedy", "needs_host_sample")

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        self.req_ids: list[Optional[str]] = [None] * max_num_seqs
        self.req_id_to_slot: dict[str, int] = {}
        self.token_ids = np.full((max_num_seqs, max_model_len), POISON, np.int64)
        self.num_tokens_known = np.zeros(max_num_seqs, np.int64)  # a.k.a. num_tokens_no_spec
        self.num_prompt_tokens = np.zeros(max_num_seqs, np.int64)
        self.num_computed_tokens = np.zeros(max_num_seqs, np.int64)
        self.block_table = np.zeros((max_num_seqs, max_blocks), np.int32)
        # Rows written since the device mirror last took them (stages/device_state.py).
        self.table_dirty = np.zeros(max_num_seqs, bool)
        # Each row's SamplingParams.is_greedy and .needs_host_sample, set at admission: the
        # last rank decides a step's sampling path from these, not from a loop over params.
        self.greedy = np.zeros(max_num_seqs, bool)
        self.needs_host_sample = np.zeros(max_num_seqs, bool)
        self.num_blocks = np.zeros(max_num_seqs, np.int64)
        self.incarnation = np.zeros(max_num_seqs, np.int64)  # the driver's admission counter
        self.last_sampled_token = np.full(max_num_seqs, POISON, np.int64)
        self.num_conflicts = np.zeros(max_num_seqs, np.int64)  # driver tokens that disagreed
        self.generation = np.zeros(max_num_seqs, np.int64)  # the slot's tenant count
        # Speculative decoding. Drafts sit at token_ids[row, known:known + num_draft_tokens].
        # num_computed_tokens counts only certain tokens: the drafts a step ran are
        # "unresolved" until this rank learns how many were accepted (the last rank at once,
        # the others from the driver's next count). num_draft_computed: the draft model's
        # valid KV prefix for this row (last rank, draft_model only).
        self.num_draft_tokens = np.zeros(max_num_seqs, np.int64)
        self.num_unresolved_drafts = np.zeros(max_num_seqs, np.int64)
        self.num_draft_computed = np.zeros(max_num_seqs, np.int64)
        # Overlap (last rank): samples launched steps made on the device whose values have not
        # reached the host yet (at most one per step in flight). They extend the known prefix
        # by as many positions; the latest one's value is in the runner's device buffer, and
        # each lands here, oldest first, when its step finishes (`land_samples`).
        self.num_pending_samples = np.zeros(max_num_seqs, np.int64)
        # The digest's running hash: token_hash over token_ids[slot, :hash_len] (see
        # ray_runtime/digest.py), moved to each step's driver length in O(tokens moved). A
        # write below hash_len rewinds hash_len to it; a full recompute (every
        # digest_full_every-th digest of the request, and every step under debug_checks)
        # catches what no write path saw (a corrupted cell) and resets the running state.
        self.hash_len = np.zeros(max_num_seqs, np.int64)
        self.hash_val = np.zeros(max_num_seqs, np.uint64)
        self.num_digests = np.zeros(max_num_seqs, np.int64)  # digests of the slot's tenant
        self.sampling: list[Optional[SamplingParams]] = [None] * max_num_seqs
        self._free_slots = list(range(max_num_seqs))  # a min-heap
        # A rank between the first and the last with token feedback: its pending samples never
        # land from a device; the driver's token for such a position resolves it. Elsewhere a
        # driver token over a pending sample is a bug (the value lands before the driver has it).
        self.driver_resolves_pending = False
        self.num_unknown_removals = 0  # removals of requests this rank never held

    # ---- the whole-step entry point ------------------------------------------------------
    def apply_plan(self, plan: StepPlan) -> None:
        """Removals, admissions, then deltas: one operation, no follow-up owed."""
        plan.check_layout()  # the order plan_view reads entries in (a list compare)
        for req_id in plan.removed_req_ids:
            self.remove(req_id)
        for new in plan.new_reqs:
            self.add(new)
        self.update_many(plan.cached_reqs)

    def slots_of(self, req_ids: list[str]) -> np.ndarray:
        """The slots of requests this rank holds (KeyError names one it does not)."""
        if not req_ids:
            return np.zeros(0, np.int64)
        got = itemgetter(*req_ids)(self.req_id_to_slot)
        return np.array(got if len(req_ids) > 1 else (got,), np.int64)

    def update_many(self, cached: CachedRequestData) -> None:
        """update() for each entry. The common one (a single token, no drafts either side, new
        blocks only appended) runs as array operations over the columns; any other, or one
        that update() would refuse, goes through update() itself."""
        n = len(cached.req_ids)
        if n < self.array_path_min:
            for d in cached.records():
                self.update(d)
            return
        slots = rows = self.slots_of(cached.req_ids)
        starts = np.array(cached.token_starts, np.int64)
        ntok = np.array(cached.num_new_tokens, np.int64)
        bstart = np.array(cached.block_starts, np.int64)
        nblocks = np.zeros(n, np.int64)
        if cached.block_entries:
            nblocks[cached.block_entries] = cached.num_new_blocks
        simple = ntok == 1
        if cached.draft_entries:
            simple[cached.draft_entries] = False
        if len(cached.new_token_ids) == n and simple.all():  # a decode step: one token each
            tokens = np.array(cached.new_token_ids, np.int64)
        else:
            tokens = np.zeros(n, np.int64)  # a simple entry's one token
            tokens[simple] = np.array(cached.new_token_ids, np.int64)[(np.cumsum(ntok) - ntok)[simple]]
        known = self.num_tokens_known[rows]
        grows = starts >= known
        have = self.num_blocks[rows]
        fast = simple & ((bstart < 0) | (bstart == have)) \
            & (have + nblocks <= self.block_table.shape[1]) \
            & (self.num_draft_tokens[rows] == 0) & (self.num_unresolved_drafts[rows] == 0) \
            & (starts <= known) & (self.driver_resolves_pending
                                   | ~(grows & (self.num_pending_samples[rows] > 0))) \
            & (starts + 1 <= self.max_model_len)
        if fast.all():  # the common step: every entry on the array path, no copies
            idx = slice(None)
        else:
            for d in cached.records(np.nonzero(~fast)[0].tolist()):
                self.update(d)
            idx = np.nonzero(fast)[0]
            rows, starts, tokens, known, grows = rows[idx], starts[idx], tokens[idx], known[idx], grows[idx]
        rewind = starts < self.hash_len[rows]  # the running hash covers the cell
        if rewind.any():
            self._rewind_hashes(rows[rewind], starts[rewind])
        overlap = ~grows  # the row holds the cell already (the last rank's own sample)
        if overlap.any():
            np.add.at(self.num_conflicts, rows[overlap],
                      self.token_ids[rows[overlap], starts[overlap]] != tokens[overlap])
        self.token_ids[rows, starts] = tokens
        if self.driver_resolves_pending:
            resolved = rows[grows & (self.num_pending_samples[rows] > 0)]
            self.num_pending_samples[resolved] -= 1
        known = np.maximum(known, starts + 1)  # grows from its own value only (invariant 1)
        self.num_tokens_known[rows] = known
        self.last_sampled_token[rows] = self.token_ids[rows, known - 1]
        # the driver's count is canonical (no drafts: it must equal ours); a self-drafted
        # request keeps its own
        theirs = np.array(cached.num_computed_tokens, np.int64)[idx]
        r = rows
        if cached.self_drafted:
            counted = np.ones(n, bool)
            counted[cached.self_drafted] = False
            counted = counted[idx]
            r, theirs = rows[counted], theirs[counted]
        self.num_conflicts[r] += self.num_computed_tokens[r] != theirs
        self.num_computed_tokens[r] = theirs
        if cached.block_entries:  # the fast entries' new blocks (the others took theirs above)
            entries = np.asarray(cached.block_entries, np.int64)
            if len(cached.new_block_ids) == len(entries):  # one each (decode): one scatter
                keep = fast[entries]
                s = slots[entries[keep]]
                nb = self.num_blocks[s]
                self.block_table[s, nb] = np.asarray(cached.new_block_ids, np.int64)[keep]
                self.table_dirty[s] = True
                self.num_blocks[s] = nb + 1
            else:
                o = 0
                for e, nb in zip(cached.block_entries, cached.num_new_blocks):
                    if fast[e]:
                        self._append_blocks(int(slots[e]), cached.new_block_ids[o:o + nb])
                    o += nb

    # ---- rows ----------------------------------------------------------------------------
    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_slot)

    def add(self, new: NewRequestData) -> int:
        if new.req_id in self.req_id_to_slot:
            raise ValueError(f"request {new.req_id!r} is already in the batch")
        n = len(new.token_ids)
        if n > self.max_model_len:
            raise ValueError(f"request {new.req_id!r}: {n} tokens > max_model_len {self.max_model_len}")
        row = self._take_free_slot()
        self.req_ids[row] = new.req_id
        self.req_id_to_slot[new.req_id] = row
        self.token_ids[row, :n] = new.token_ids
        self.token_ids[row, n:] = POISON
        self.num_tokens_known[row] = n
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.block_table[row, :] = 0
        self.table_dirty[row] = True
        self.num_blocks[row] = 0
        self._append_blocks(row, new.block_ids)
        self.incarnation[row] = new.incarnation
        # The previous tenant's last token must never feed this one (docs/invariants.md, 3).
        self.last_sampled_token[row] = new.token_ids[-1] if n else POISON
        self.num_conflicts[row] = 0
        self.num_draft_tokens[row] = 0  # the previous tenant's drafts are gone (docs/invariants.md, 3)
        self.num_unresolved_drafts[row] = 0
        self.num_draft_computed[row] = 0
        self.num_pending_samples[row] = 0
        self.hash_len[row] = 0  # the running hash starts over for the new tenant
        self.hash_val[row] = 0
        self.num_digests[row] = 0
        self.sampling[row] = new.sampling
        self.greedy[row] = new.sampling.is_greedy
        self.needs_host_sample[row] = new.sampling.needs_host_sample
        self.generation[row] += 1
        return row

    def update(self, delta: CachedRequest) -> None:
        row = self.req_id_to_slot[delta.req_id]
        have = int(self.num_blocks[row])
        start = have if delta.block_start is None else delta.block_start
        if start > have:  # refused before anything changes
            raise AssertionError(f"request {delta.req_id!r}: blocks start at {start} but the "
                                 f"row holds {have}")
        if start + len(delta.new_block_ids) > self.block_table.shape[1]:
            raise AssertionError(f"request {delta.req_id!r}: block table overflow")
        self.write_tokens(delta.req_id, delta.token_start, delta.new_token_ids)  # may refuse: first
        if delta.self_drafted:
            # The rank is ahead of the plan: its own tokens, drafts and count stand (the
            # driver corrects its optimistic view, and the audit checks the result).
            self._append_blocks_from(row, delta)
            return
        self.set_drafts(delta.req_id, delta.draft_token_ids)
        own = int(self.num_computed_tokens[row])
        unresolved = int(self.num_unresolved_drafts[row])
        # The driver's count is canonical. It may exceed ours by the drafts it has seen
        # accepted; anything else is a slip: take its count, and let the digest report it.
        if not own <= delta.num_computed_tokens <= own + unresolved:
            self.num_conflicts[row] += 1
        self.num_computed_tokens[row] = delta.num_computed_tokens
        self.num_unresolved_drafts[row] = 0
        self._append_blocks_from(row, delta)

    def _append_blocks_from(self, row: int, delta: CachedRequest) -> None:
        if delta.block_start is None and not delta.new_block_ids:
            return
        if delta.block_start is not None:  # checked in update()
            self.block_table[row, delta.block_start:] = 0  # rolled back: rejected drafts' blocks
            self.table_dirty[row] = True
            self.num_blocks[row] = delta.block_start
        self._append_blocks(row, delta.new_block_ids)

    def write_tokens(self, req_id: str, start: int, tokens: list[int]) -> None:
        """Place the driver's tokens [start, start + len) in the row. Positions the row
        already knows (the last rank appends its own samples first) are overwritten by the
        driver's canonical values, and each disagreement is counted for the digest."""
        if not tokens:
            return
        row = self.req_id_to_slot[req_id]
        known = int(self.num_tokens_known[row])
        if start > known:
            raise AssertionError(f"request {req_id!r}: driver tokens start at {start} but the "
                                 f"row knows only {known}: a gap")
        end = start + len(tokens)
        if end > self.max_model_len:
            raise ValueError(f"request {req_id!r}: {end} tokens > max_model_len {self.max_model_len}")
        if start < self.hash_len[row]:  # the running hash covers cells about to be rewritten
            self._rewind_hashes(np.array([row]), np.array([start]))
        overlap = min(end, known) - start
        if overlap == 1:  # the common case (a decode step's token): no array round trip
            self.num_conflicts[row] += int(self.token_ids[row, start]) != tokens[0]
        elif overlap > 0:
            held = self.token_ids[row, start:start + overlap]
            self.num_conflicts[row] += int((held != np.asarray(tokens[:overlap])).sum())
        if end > known:  # the known prefix grows over where drafts were: they are spent
            pending = int(self.num_pending_samples[row])
            if pending and not self.driver_resolves_pending:
                raise AssertionError(f"request {req_id!r}: driver tokens over a pending sample")
            self.num_pending_samples[row] = max(0, pending - (end - known))
            if self.num_draft_tokens[row]:
                self._clear_drafts(row)
            # Grows from its own value only: never derived from num_computed_tokens (docs/invariants.md, 1).
            self.num_tokens_known[row] = known = end
        if len(tokens) == 1:
            self.token_ids[row, start] = tokens[0]
        else:
            self.token_ids[row, start:end] = tokens
        self.last_sampled_token[row] = self.token_ids[row, known - 1]

    def append_tokens(self, req_id: str, new_token_ids: list[int]) -> None:
        """Extend the known prefix at its end (the last rank's own samples)."""
        row = self.req_id_to_slot[req_id]
        self.write_tokens(req_id, int(self.num_tokens_known[row]), new_token_ids)

    def set_drafts(self, req_id: str, drafts: list[int]) -> None:
        """Make `drafts` the row's drafts. Where the row held drafts already (the last rank
        proposed them), a different value in the overlap counts as a conflict."""
        row = self.req_id_to_slot[req_id]
        held = int(self.num_draft_tokens[row])
        if not drafts and not held:
            return
        known = int(self.num_tokens_known[row])
        if known + len(drafts) > self.max_model_len:
            raise ValueError(f"request {req_id!r}: {known} tokens + {len(drafts)} drafts > "
                             f"max_model_len {self.max_model_len}")
        overlap = min(held, len(drafts))
        if overlap:
            cur = self.token_ids[row, known:known + overlap]
            self.num_conflicts[row] += int((cur != np.asarray(drafts[:overlap])).sum())
        self._clear_drafts(row)
        self.token_ids[row, known:known + len(drafts)] = drafts
        self.num_draft_tokens[row] = len(drafts)

    def drafts(self, req_id: str) -> list[int]:
        row = self.req_id_to_slot[req_id]
        known = int(self.num_tokens_known[row])
        return self.token_ids[row, known:known + int(self.num_draft_tokens[row])].tolist()

    def mark_computed(self, req_id: str, num_tokens: int) -> None:
        """A step ran num_tokens of the request: its drafts among them stay unresolved."""
        self.mark_computed_rows(np.array([self.req_id_to_slot[req_id]]), np.array([num_tokens]))

    def mark_computed_rows(self, rows: np.ndarray, num_tokens: np.ndarray) -> None:
        """mark_computed for a step's rows at once (rows distinct)."""
        drafts = self.num_draft_tokens[rows]
        self.num_computed_tokens[rows] += num_tokens - drafts
        self.num_unresolved_drafts[rows] = drafts

    def expect_samples(self, slots: np.ndarray) -> np.ndarray:
        """A launched step will sample one token for each of these slots (no drafts): the
        known prefix grows by a pending position now, its value lands later. Returns the
        slots' generations, which `land_samples` checks."""
        assert not self.num_draft_tokens[slots].any(), "a deferred sample beside drafts"
        self.num_pending_samples[slots] += 1
        return self.generation[slots].copy()

    def land_samples(self, slots: np.ndarray, generations: np.ndarray,
                     tokens: np.ndarray) -> np.ndarray:
        """The values of the samples `expect_samples` announced. A slot whose tenant changed
        meanwhile (removed, maybe re-admitted: invariant 3) drops its late value. Returns
        the mask of the samples that landed."""
        live = (self.generation[slots] == generations) & (self.num_pending_samples[slots] > 0)
        s, t = slots[live], tokens[live]
        known = self.num_tokens_known[s]
        self.token_ids[s, known] = t
        self.num_tokens_known[s] = known + 1
        self.last_sampled_token[s] = t
        self.num_pending_samples[s] -= 1
        return live

    def append_samples(self, req_ids: list[str], samples: list[list[int]]) -> None:
        """The last rank's own samples, request by request: append_tokens, then
        resolve_drafts with all but the last sample as accepted drafts. The common step (one
        token per request, no drafts in any row, room in every row) runs as array ops."""
        rows = np.array([self.req_id_to_slot[r] for r in req_ids], np.int64)
        known = self.num_tokens_known[rows]
        if all(len(t) == 1 for t in samples) and not self.num_draft_tokens[rows].any() \
                and not self.num_unresolved_drafts[rows].any() and (known < self.max_model_len).all():
            tokens = np.array([t[0] for t in samples], np.int64)
            self.token_ids[rows, known] = tokens
            self.num_tokens_known[rows] = known + 1
            self.last_sampled_token[rows] = tokens
            return
        for req_id, toks in zip(req_ids, samples):
            self.append_tokens(req_id, toks)
            self.resolve_drafts(req_id, len(toks) - 1)

    def resolve_drafts(self, req_id: str, num_accepted: int) -> None:
        """The last rank's verdict: the first num_accepted drafts become computed tokens."""
        row = self.req_id_to_slot[req_id]
        assert num_accepted <= self.num_unresolved_drafts[row], (req_id, num_accepted)
        self.num_computed_tokens[row] += num_accepted
        self.num_unresolved_drafts[row] = 0

    def remove(self, req_id: str) -> bool:
        """Free the request's slot. A request this rank does not hold (the driver aborted
        it before any plan reached the rank) is a counted no-op, not a crash."""
        slot = self.req_id_to_slot.pop(req_id, None)
        if slot is None:
            self.num_unknown_removals += 1
            return False
        self._clear_row(slot)
        heapq.heappush(self._free_slots, slot)
        return True

    def digests(self, plan: StepPlan, full: bool = False, full_every: int = 0) -> RowDigests:
        """digests_of(plan_view(plan, self)): for callers without a view at hand."""
        return self.digests_of(plan_view(plan, self), full, full_every)

    def digests_of(self, view: PlanView, full: bool = False, full_every: int = 0) -> RowDigests:
        """Fingerprints of every request the step runs, over the prefix it stands on (the
        view's digest_len). The running hashes move by the tokens since the last digest; a
        slot's hash is recomputed from its contents instead (and the running state reset to
        that) when `full`, and at every full_every-th digest of that request (0: never)."""
        req_ids, rows, lengths = view.req_ids, view.slots, view.digest_len
        have = self.hash_len[rows]
        lo = np.minimum(have, lengths)
        with np.errstate(over="ignore"):
            known_hash = self.hash_val[rows] + spans_hash_delta(self.token_ids, rows, lo, lengths)
            if (have > lengths).any():  # a row whose hash ran past the prefix: take it back
                known_hash -= spans_hash_delta(self.token_ids, rows, lo, have)
        self.num_digests[rows] += 1
        recompute = np.ones(len(rows), bool) if full else \
            (self.num_digests[rows] % full_every == 0 if full_every else np.zeros(len(rows), bool))
        if recompute.any():
            known_hash[recompute] = rows_hash(self.token_ids, rows[recompute], lengths[recompute])
        self.hash_val[rows] = known_hash
        self.hash_len[rows] = lengths
        drafts = self.num_draft_tokens[rows]
        hashes = known_hash
        if drafts.any():  # drafts follow the known prefix, so one hash over both covers them
            with np.errstate(over="ignore"):
                hashes = known_hash + spans_hash_delta(self.token_ids, rows, lengths, lengths + drafts)
        return RowDigests(
            list(req_ids), self.incarnation[rows].tolist(), self.num_tokens_known[rows].tolist(),
            lengths.tolist(), self.num_computed_tokens[rows].tolist(), hashes.tolist(),
            self.num_conflicts[rows].tolist(), drafts.tolist())

    # ---- internals -----------------------------------------------------------------------
    def _rewind_hashes(self, rows: np.ndarray, lengths: np.ndarray) -> None:
        """Take the running hashes of `rows` back to `lengths` (each below its hash_len),
        before the cells past them are rewritten."""
        with np.errstate(over="ignore"):
            self.hash_val[rows] -= spans_hash_delta(self.token_ids, rows, lengths, self.hash_len[rows])
        self.hash_len[rows] = lengths

    def _take_free_slot(self) -> int:
        if not self._free_slots:
            raise RuntimeError(f"InputBatch full: max_num_seqs={self.max_num_seqs}")
        return heapq.heappop(self._free_slots)  # lowest first: live slots stay dense

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.table_dirty[row] = True
        self.num_blocks[row] = start + len(block_ids)

    def _clear_drafts(self, row: int) -> None:
        known = int(self.num_tokens_known[row])
        self.token_ids[row, known:known + int(self.num_draft_tokens[row])] = POISON
        self.num_draft_tokens[row] = 0

    def _clear_row(self, row: int) -> None:
        self.req_ids[row] = None
        self.token_ids[row, :] = POISON
        for name in self._ROW_SCALARS:
            getattr(self, name)[row] = 0
        self.last_sampled_token[row] = POISON
        self.block_table[row] = 0
        self.table_dirty[row] = True
        self.sampling[row] = None

    # ---- invariants ----------------------------------------------------------------------
    def check(self) -> None:
        assert len(self.req_id_to_slot) == sum(r is not None for r in self.req_ids)
        free = sorted(self._free_slots)
        assert len(set(free)) == len(free), "a slot is free twice"
        assert sorted(free + list(self.req_id_to_slot.values())) == list(range(self.max_num_seqs)), \
            "free and live slots do not partition the batch"
        for req_id, row in self.req_id_to_slot.items():
            assert self.req_ids[row] == req_id, f"row map broken for {req_id!r}"
        for row, req_id in enumerate(self.req_ids):
            known = int(self.num_tokens_known[row])
            if req_id is None:
                assert known == 0 and self.num_computed_tokens[row] == 0, f"hole {row} not clear"
                assert self.sampling[row] is None
                continue
            computed = int(self.num_computed_tokens[row])
            prompt = int(self.num_prompt_tokens[row])
            where = f"request {req_id!r} (row {row})"
            assert prompt <= known <= self.max_model_len, \
                f"{where}: known prefix {known} shorter than its prompt {prompt}"
            pending = int(self.num_pending_samples[row])
            assert pending >= 0 and not (pending and self.num_draft_tokens[row]), \
                f"{where}: {pending} pending samples"
            assert 0 <= computed <= known + pending, f"{where}: computed {computed} > known {known}"
            held = known + int(self.num_draft_tokens[row])
            assert held <= self.max_model_len, f"{where}: drafts past max_model_len"
            assert (self.token_ids[row, :held] >= 0).all(), f"{where}: poison inside known prefix or drafts"
            assert (self.token_ids[row, held:] == POISON).all(), f"{where}: stale tokens past prefix"
            assert self.num_draft_computed[row] <= known, f"{where}: draft KV past the known prefix"
            assert self.last_sampled_token[row] == self.token_ids[row, known - 1], \
                f"{where}: last_sampled_token is not the last known token"
            assert int(self.num_blocks[row]) * self.block_size >= computed, \
                f"{where}: computed tokens without KV blocks"
            assert self.sampling[row] is not None
            assert self.greedy[row] == self.sampling[row].is_greedy and \
                self.needs_host_sample[row] == self.sampling[row].needs_host_sample, \
                f"{where}: sampling flags disagree with its SamplingParams"
