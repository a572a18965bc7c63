"""Sampled tokens from the last rank straight to rank 0, without a driver round trip.

At PP>1 with async scheduling (EngineConfig.feeds_tokens_back) the driver plans a
micro-batch's next step before the tokens of its running step are known: each of its decode
requests runs on its pending sample (a placeholder), as at PP=1. Rank 0 must embed those
tokens, so the last rank sends every step's samples to rank 0 over a link of their own (a
process group apart from the activations', so its transfers never queue behind them), and
rank 0 feeds them into the next step's input ids on the device. The driver still commits
every token from the last rank's reply and sends it in a later plan: rank 0 lands the fed
value in its row first (`finish`, before it replies to the step), so the driver's copy
overlaps it and any disagreement is counted as a conflict, which the audit reports.

Wire format: one int64 message per step that samples: the n tokens in the plan's sample
order (the order every rank derives from the same plan), then the step id, checked when
the message lands. Both ends know n from the plan, so the sizes always match. A last rank
that fails a step sends -(step id + 1) instead, so rank 0 fails that step at once too.

Receiving, on CUDA: the receive is posted when rank 0 launches the step; a side stream waits
for it, scatters the tokens into `last_sampled` (one entry per slot), copies them to a
pinned host buffer and records `ready`. Nothing on the compute stream waits unless a later
step embeds one of those tokens: then that step waits for `ready` of the newest step it
needs (the side stream runs in step order, so older steps are done too). On CPU a waiter
thread waits for each receive in turn (a gloo receive reports completion only to a wait),
so the step loop can ask whether a step's tokens are in without blocking.
"""
from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque
from typing import Optional

import numpy as np
import torch

from stages.pinned_ring import PinnedRing
from stages.profiling import phase
from stages.plan_view import planned_spans

FEEDBACK_TAG = 2
SENDER, RECEIVER = 1, 0  # group-local ranks: the last rank and rank 0


class FeedbackError(RuntimeError):
    """The tokens that reached rank 0 are not the step's it expected."""


class _Incoming:
    __slots__ = ("step_id", "slots", "generations", "buf", "work", "ready", "fed", "host",
                 "scattered", "arrived", "discard")

    def __init__(self, step_id, slots, generations, buf, work) -> None:
        self.step_id = step_id
        self.slots = slots  # [n] host: the rank's slots, in the plan's sample order
        self.generations = generations  # [n] at launch: a changed one drops its late value
        self.buf = buf  # [n + 1] where the message lands
        self.work = work
        self.ready = None  # CUDA: the side stream's event after scatter and host copy
        self.fed = None  # CUDA: the side stream's event after the scatter
        self.host = None  # CUDA: the pinned copy
        self.scattered = False  # CPU: last_sampled written
        self.arrived = threading.Event()  # CPU: set by the waiter thread once received
        self.discard = False  # a step rank 0 failed itself: its message is received, unread


def num_samples(plan) -> int:
    """How many requests a plan samples for (those whose tokens reach the end of their known
    prefix), from the plan alone: what both ends size a step's message by, when the rank's
    own view of the plan is not at hand (a step that failed)."""
    starts, known = planned_spans(plan)
    return int((starts + np.array(plan.num_scheduled_tokens, np.int64) >= known).sum())


class TokenSender:
    """The last rank's end: one message per step that samples."""

    def __init__(self, group, device: str) -> None:
        self.group = group
        self.device = device
        self._sends: deque = deque()  # (work, tensor): kept alive until the send completes
        self.last_sent_step: Optional[int] = None

    def send(self, step_id: int, tokens: torch.Tensor) -> None:
        n = tokens.shape[0]
        if n == 0:
            return
        msg = torch.empty(n + 1, dtype=torch.long, device=tokens.device)
        msg[:n] = tokens
        # A kernel with the id as its argument. (`msg[n] = step_id` copies a host scalar: on
        # CUDA a synchronous copy, which held the last rank's host until its device had
        # finished the step, ~4 ms a step on an 8B model.)
        msg[n:].fill_(step_id)
        self._send(msg)
        self.last_sent_step = step_id

    def send_failure(self, step_id: int, n: int) -> None:
        """This rank failed step_id, which samples n requests: rank 0 fails it too."""
        if n and self.last_sent_step != step_id:
            self.last_sent_step = step_id
            self._send(torch.full((n + 1,), -(step_id + 1), dtype=torch.long, device=self.device))

    def _send(self, msg: torch.Tensor) -> None:
        # NCCL reports a send's completion; a gloo send does only to a wait, and completes
        # only once rank 0 has posted the matching receive (it does so when it launches the
        # step, before this rank can run it; for a step it failed itself, in post_discard).
        while self._sends and (self.device != "cuda" or self._sends[0][0].is_completed()):
            self._sends.popleft()[0].wait()
        self._sends.append((self.group.send([msg], RECEIVER, FEEDBACK_TAG), msg))


class TokenReceiver:
    """Rank 0's end: posts a receive per sampling step, feeds the tokens to the device buffer
    that the input-id patch reads, and hands their values to the host when the step ends."""

    def __init__(self, group, device: str, max_num_seqs: int, max_inflight_steps: int = 1,
                 last_sampled: Optional[torch.Tensor] = None,
                 stream: Optional["torch.cuda.Stream"] = None) -> None:
        self.group = group
        self.device = device
        # [>= max_num_seqs] each slot's latest fed sample (the patch reads a slot's entry only
        # for a pending sample, which only its current tenant can have: invariant 3); the
        # runner's, which its decode graphs read, or one of its own
        self.last_sampled = last_sampled if last_sampled is not None else \
            torch.zeros(max_num_seqs, dtype=torch.long, device=device)
        # [max_num_seqs] host: the step that made each slot's latest pending sample
        self.pending_step = np.full(max_num_seqs, -1, np.int64)
        self._incoming: deque[_Incoming] = deque()  # posted, in step order
        self.failed: Optional[str] = None  # set once a message is not what its step expected
        # CUDA: the side stream its scatters run on. A runner that re-forms the link hands
        # each new receiver the same stream with the same last_sampled: a closed receiver's
        # scatters still queued (the link reset dropped their messages) then run before the
        # new receiver's, which every later read waits for.
        self._stream = None if device != "cuda" else \
            stream if stream is not None else torch.cuda.Stream()
        if self._stream is not None:
            # Written on the side stream: its memory is not reused before that work is done.
            self.last_sampled.record_stream(self._stream)
            # Host copies, more than the steps rank 0 keeps unlanded.
            self._pinned = PinnedRing(max_inflight_steps + 2, max_num_seqs + 1, torch.long,
                                      pin=True)
        self._to_wait: Optional[queue.SimpleQueue] = None
        if self._stream is None:
            self._to_wait = queue.SimpleQueue()
            threading.Thread(target=self._wait_in_turn, args=(self._to_wait,),
                             name="token-feedback-waiter", daemon=True).start()

    @staticmethod
    def _wait_in_turn(to_wait: queue.SimpleQueue) -> None:
        while True:
            entry = to_wait.get()
            if entry is None:
                return
            try:
                entry.work.wait()
            except Exception:  # noqa: BLE001 - the link was torn down: land() waits again and raises
                pass
            entry.arrived.set()

    def close(self) -> None:
        if self._to_wait is not None:
            self._to_wait.put(None)

    def post(self, step_id: int, slots: np.ndarray, generations: np.ndarray,
             device_slots: Optional[torch.Tensor] = None) -> None:
        """A launched step will sample `slots` (host) on the last rank; device_slots: the same
        on the device (CUDA), valid on the current stream now."""
        n = len(slots)
        if n == 0:
            return
        buf = torch.empty(n + 1, dtype=torch.long, device=self.device)
        with phase("post feedback recv"):
            entry = self._register(step_id, slots, generations, buf)
        self.pending_step[slots] = step_id
        if self._stream is None:
            self._to_wait.put(entry)
            return
        # The staged slot indices are rewritten by later steps: keep this step's copy.
        dev_slots = device_slots.clone()
        with self._on_side_stream(entry):
            # A failure message's values are negative: never an embedding index (a
            # device-side assert would end the process); land() raises for that step.
            self.last_sampled[dev_slots] = buf[:n].clamp(min=0)
            entry.fed = torch.cuda.Event()
            entry.fed.record()  # what a step embedding these samples waits for
            entry.host = self._pinned.next(n + 1)
            entry.host.copy_(buf, non_blocking=True)
        dev_slots.record_stream(self._stream)

    def _register(self, step_id: int, slots: np.ndarray, generations: np.ndarray,
                  buf: torch.Tensor) -> _Incoming:
        """Post the step's receive and queue its entry at once: nothing can fail between
        the two, so a step never gets a second receive (post_discard looks for the entry)."""
        entry = _Incoming(step_id, slots, generations, buf,
                          self.group.recv([buf], SENDER, FEEDBACK_TAG))
        self._incoming.append(entry)
        return entry

    @contextlib.contextmanager
    def _on_side_stream(self, entry: _Incoming):
        """CUDA: the side stream, after the compute stream's work so far, waits for the
        entry's message; the body runs on it after that; then `ready` is recorded."""
        compute = torch.cuda.current_stream()
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(compute)
            entry.work.wait()  # this stream, not the host, waits for the message
            yield
            entry.ready = torch.cuda.Event()
            entry.ready.record()
        entry.buf.record_stream(self._stream)


    def post_discard(self, step_id: int, n: int) -> None:
        """Rank 0 failed step_id (which samples n requests) before posting its receive: the
        last rank still sends one message for it (its failure), so receive that and drop it.
        Every sampling step gets exactly one message and one receive, so the link stays
        aligned and no send waits for a receive that never comes."""
        if n == 0 or any(e.step_id == step_id for e in self._incoming):
            return
        buf = torch.empty(n + 1, dtype=torch.long, device=self.device)
        entry = self._register(step_id, np.empty(0, np.int64), np.empty(0, np.int64), buf)
        entry.discard = True
        if self._stream is None:
            self._to_wait.put(entry)
            return
        with self._on_side_stream(entry):
            pass

    def feed(self, patch_slots: np.ndarray) -> int:
        """Before a step embeds the pending samples of `patch_slots` (read from last_sampled):
        make the compute stream (CUDA) or the host (CPU) wait for the steps that made them.
        Returns the newest of those steps whose samples it waited for, -1 for none (all in
        already): what the trace shows as the step's `fed_from`."""
        if self.failed is not None:
            raise FeedbackError(self.failed)
        if not len(patch_slots) or not self._incoming:
            return -1
        needed = int(self.pending_step[patch_slots].max())
        if self._stream is not None:
            for entry in reversed(self._incoming):
                if entry.step_id <= needed and entry.fed is not None:
                    torch.cuda.current_stream().wait_event(entry.fed)
                    return entry.step_id
            return -1
        waited = -1
        for entry in self._incoming:
            if entry.step_id > needed:
                break
            self._scatter(entry)
            waited = entry.step_id
        return waited

    def _scatter(self, entry: _Incoming) -> None:
        if not entry.scattered:
            entry.arrived.wait()
            n = len(entry.slots)
            if not entry.discard:
                self._check(entry, int(entry.buf[n]))
            self.last_sampled[torch.from_numpy(entry.slots)] = entry.buf[:n]
            entry.scattered = True

    def _check(self, entry: _Incoming, got: int) -> None:
        """The message carries entry's step id, or rank 0 fails: that step, and every later
        one that lands or feeds on this link (it is out of step until the driver resets it)."""
        if self.failed is None:
            if got < 0 and -got - 1 == entry.step_id:
                self.failed = (f"the last rank failed step {entry.step_id} and sent no tokens "
                               "for it")
            elif got != entry.step_id:
                self.failed = (f"rank 0 expected step {entry.step_id}'s sampled tokens from the "
                               f"last rank, but they are step {got}'s: refused")
        if self.failed is not None:
            raise FeedbackError(self.failed)

    def ready(self, step_id: int) -> bool:
        """Whether land(step_id) would return without waiting."""
        for entry in self._incoming:
            if entry.step_id == step_id:
                return entry.ready.query() if entry.ready is not None else entry.arrived.is_set()
            if entry.step_id > step_id:
                break
        return True

    def land(self, step_id: int, batch) -> None:
        """The step's fed tokens into the rows (InputBatch.land_samples), in step order; a
        step that sampled nothing has no message."""
        if self.failed is not None:
            raise FeedbackError(self.failed)
        while self._incoming and self._incoming[0].step_id <= step_id:
            entry = self._incoming.popleft()
            if entry.discard:  # a step rank 0 failed: whatever came for it is dropped
                if entry.ready is not None:
                    entry.ready.synchronize()
                else:
                    entry.arrived.wait()
                continue
            if entry.ready is not None:
                entry.ready.synchronize()
                values = entry.host
            else:
                self._scatter(entry)
                values = entry.buf
            n = len(entry.slots)
            self._check(entry, int(values[n]))
            batch.land_samples(entry.slots, entry.generations, values[:n].numpy().copy())

    def num_posted(self) -> int:
        return len(self._incoming)
