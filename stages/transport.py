"""Activations between neighbouring stages over torch.distributed point-to-point: gloo on CPU,
NCCL on GPU (with gloo beside it for the headers). Rank 0 holds the rendezvous store, bound to
its node's address at a port the OS chose there; the driver hands that address to the other
ranks (ray_runtime/link.py). Nothing is hard-coded.

Every transfer is step-tagged: a header of four int64s, (step id, status, num_tokens,
hidden_size), travels with the activations of each step (the wire formats are on
StageTransport). The receiver checks it against its own plan:

- another step's activations, or another shape: refused with `StepMismatch`, naming both
  steps and both ranks, instead of computing on them. The message is received whole first
  (its size comes from the header), so no transport aborts on a size mismatch and the link
  stays aligned;
- a failure header (the sender failed the step before it had activations to send): refused
  with `UpstreamFailed` at once, instead of waiting for a timeout. A stage that fails a step
  sends one (`StageRunner.launch`), so a failure travels down the pipeline in milliseconds
  and every stage answers the driver.

After any failed step the driver resets the link (ray_runtime/link.py: every stage closes its
process group, rank 0 opens a fresh store, every stage joins it), which drops whatever the
failed steps left in flight. A transfer that waits longer than the engine's step_timeout_s
fails.
"""
from __future__ import annotations

import socket
from datetime import timedelta
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from stages.profiling import phase

LINK_TAG, BULK_TAG = 0, 1  # a step's header message; activations sent apart from it
INLINE, FOLLOWS, FAILED = 0, 1, 2  # header status: activations inline, on BULK_TAG, none
HEADER_BYTES = 32  # four int64: step_id, status, num_tokens, hidden_size
INLINE_BYTES = 64 * 1024  # CPU: activations up to this size travel inside the header message
RENDEZVOUS_TIMEOUT_S = 60.0  # how long a rank waits to reach the store


class LinkError(RuntimeError):
    """An activation transfer between two stages was refused."""


class StepMismatch(LinkError):
    """The receiver got another step's activations, or another shape than its plan says."""


class UpstreamFailed(LinkError):
    """The previous stage failed this step and sent no activations."""


def open_rendezvous(host: str) -> tuple[dist.TCPStore, int]:
    """Rank 0's rendezvous store, listening on `host` only (this node's address), at a port
    the OS picks. torch's TCPStore would listen on every interface if it bound the port
    itself; handed an already bound and listening socket (`master_listen_fd`), it serves on
    that socket and takes ownership of it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
                          master_listen_fd=sock.detach())
    return store, port


def connect_rendezvous(host: str, port: int) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False,
                         timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S))


class StageTransport:
    """One rank's end of the link: receives activations (num_tokens x hidden_size of dtype)
    from rank - 1, sends them to rank + 1. `group` is a torch ProcessGroup whose ranks are
    the pipeline ranks (the default group in a stage; a bare ProcessGroupGloo in the unit
    tests).

    Each step is one host message on LINK_TAG, rows of hidden_size: the header in row 0,
    then, when the activations are on the host and fit in inline_bytes, the activations
    themselves (copied once on the sender, into a buffer it reuses once the previous send is
    done). Otherwise (on GPU always, on CPU for large prefill chunks) the header says that
    they follow, and they travel alone on BULK_TAG (over NCCL on GPU: they never touch the
    host), received at the header's size.

    The receiver keeps the next step's header receive posted, into a buffer of the most rows
    a message can hold: gloo takes a message shorter than the posted buffer (never a longer
    one; the sender never sends one), so a decode step costs one one-way message, as it did
    untagged, and a large step one small message more."""

    def __init__(self, rank: int, world_size: int, device: str, group, hidden_size: int,
                 dtype: torch.dtype, inline_bytes: int = INLINE_BYTES,
                 owns_default_group: bool = False) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.group = group
        self.hidden_size, self.dtype = hidden_size, dtype
        row_bytes = hidden_size * torch.empty(0, dtype=dtype).element_size()
        if row_bytes < HEADER_BYTES:
            raise ValueError(f"hidden_size: a row of {hidden_size} x {dtype} is {row_bytes} "
                             f"bytes, less than the {HEADER_BYTES}-byte header it must hold")
        # Rows of activations a step's message carries inline (none where they live on a GPU).
        self.inline_rows = inline_bytes // row_bytes if device == "cpu" else 0
        self._owns_default_group = owns_default_group
        self._pending: list = []  # (work, tensor) of the last step's sends, kept alive
        self.last_sent_step: Optional[int] = None  # the last step sent on (data or failure)
        self.received_step: Optional[int] = None  # the step the last message was taken for
        self._posted: Optional[tuple] = None  # (work, buffer, header): the next receive
        self._out: Optional[tuple] = None  # (buffer, header) the sender reuses
        # The last rank -> rank 0 link of sampled tokens (stages/token_feedback.py): a group
        # of its own, on rank 0 and the last rank only; None elsewhere or when unused.
        self.feedback_group = None

    @classmethod
    def connect(cls, rank: int, world_size: int, device: str, store, timeout_s: float,
                hidden_size: int, dtype: torch.dtype, feedback: bool = False) -> "StageTransport":
        """Join the stages' process group through `store`. timeout_s bounds every transfer
        (the engine's step_timeout_s): a stage waiting on a neighbour that never sends fails
        within it. feedback: also form the last rank -> rank 0 token link (every rank takes
        part in forming it), and exchange one message on it so that it is up before the
        first step."""
        # Headers are host tensors: on GPU they travel over gloo, the activations over NCCL.
        backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        transport = cls(rank, world_size, device, dist.group.WORLD, hidden_size, dtype,
                        owns_default_group=True)
        if feedback:
            group = dist.new_group([0, world_size - 1], timeout=timedelta(seconds=timeout_s),
                                   backend="nccl" if device == "cuda" else "gloo")
            if rank in (0, world_size - 1):
                transport.feedback_group = group
                probe = torch.zeros(1, dtype=torch.long, device=device)
                if rank == 0:
                    group.recv([probe], 1, 0).wait()
                else:
                    group.send([probe], 0, 0).wait()
                if device == "cuda":
                    torch.cuda.synchronize()
        return transport

    # ---- receiving -----------------------------------------------------------------------
    def recv_from_prev(self, step_id: int, num_tokens: int) -> torch.Tensor:
        """This step's activations from rank - 1, after checking that they are this step's,
        of this shape. Refused: StepMismatch, or UpstreamFailed (the sender failed the step);
        either way the message was received whole, and the link stays aligned."""
        src = self.rank - 1
        got_step, status, got_tokens, got_hidden, acts = self._take(step_id)
        if status == FAILED:
            raise UpstreamFailed(f"rank {self.rank}: rank {src} failed step {got_step} and sent "
                                 f"no activations (this rank was at step {step_id})")
        if (got_step, got_tokens) != (step_id, num_tokens):
            raise StepMismatch(
                f"rank {self.rank} expected step {step_id}'s activations ({num_tokens} tokens x "
                f"{self.hidden_size}) from rank {src}, but rank {src} sent step {got_step}'s "
                f"({got_tokens} tokens x {got_hidden}): the link is out of step; refused")
        return acts

    def discard_from_prev(self, step_id: int) -> None:
        """This rank failed step_id before it took the step's message: take it now and drop
        it, unless it already did. Every step takes exactly one message from rank - 1 (its
        activations or its failure), so the link stays aligned and the sender's next send
        never waits for a receive that does not come (a gloo send completes only once its
        receive is posted)."""
        if self.received_step != step_id:
            self._take(step_id)

    def _take(self, step_id: int) -> tuple:
        """The next message from rank - 1, whole: (step, status, tokens, hidden, activations
        or None), taken on behalf of step_id."""
        src = self.rank - 1
        work, buf, header = self._posted or self._post_header()
        with phase("header wait"):
            work.wait()
        self.received_step = step_id
        self._posted = self._post_header()  # the next message will not wait to be asked for
        got_step, status, got_tokens, got_hidden = header.tolist()
        if status == FAILED:
            return got_step, status, got_tokens, got_hidden, None
        if (status not in (INLINE, FOLLOWS) or got_hidden != self.hidden_size
                or (status == INLINE and got_tokens > self.inline_rows)):
            raise LinkError(f"rank {self.rank}: a malformed header from rank {src}: step "
                            f"{got_step}, status {status}, {got_tokens} tokens x {got_hidden}")
        if status == INLINE:
            acts = buf[1:1 + got_tokens]
        else:
            acts = torch.empty((got_tokens, got_hidden), dtype=self.dtype, device=self.device)
            self.group.recv([acts], src, BULK_TAG).wait()
        return got_step, status, got_tokens, got_hidden, acts

    def _post_header(self) -> tuple:
        buf, header = self._rows()
        return self.group.recv([buf], self.rank - 1, LINK_TAG), buf, header

    def _rows(self) -> tuple[torch.Tensor, np.ndarray]:
        """A step's message buffer (header row, then the inline rows), and its header (row
        0's first bytes) as int64s."""
        buf = torch.empty((1 + self.inline_rows, self.hidden_size), dtype=self.dtype)
        return buf, buf.view(torch.uint8).numpy()[0, :HEADER_BYTES].view(np.int64)

    # ---- sending -------------------------------------------------------------------------
    def send_to_next(self, step_id: int, hidden: torch.Tensor) -> None:
        """Non-blocking: the stage goes on to its next plan while this one travels. At most
        one step's sends are outstanding; their tensors are kept alive until they complete."""
        num_tokens, hidden_size = hidden.shape
        if hidden_size != self.hidden_size:
            raise LinkError(f"rank {self.rank}: step {step_id}'s activations have "
                            f"{hidden_size} columns; the link carries {self.hidden_size}")
        with phase("wait sends"):
            self.wait_sends()  # the message buffer is free again
        if num_tokens <= self.inline_rows:
            buf = self._header(step_id, INLINE, num_tokens)
            buf[1:1 + num_tokens].copy_(hidden)
            self._send(buf[:1 + num_tokens], LINK_TAG)
        else:
            self._send(self._header(step_id, FOLLOWS, num_tokens)[:1], LINK_TAG)
            self._send(hidden.contiguous(), BULK_TAG)
        self.last_sent_step = step_id

    def send_failure(self, step_id: int) -> None:
        """Tell the next rank that this one failed step_id, unless it already sent for it."""
        if self.last_sent_step == step_id:
            return
        self.wait_sends()
        self._send(self._header(step_id, FAILED, 0)[:1], LINK_TAG)
        self.last_sent_step = step_id

    def _header(self, step_id: int, status: int, num_tokens: int) -> torch.Tensor:
        """The reused message buffer, its header written (only once no send reads it)."""
        if self._out is None:
            self._out = self._rows()
        buf, header = self._out
        header[:] = (step_id, status, num_tokens, self.hidden_size)
        return buf

    def _send(self, tensor: torch.Tensor, tag: int) -> None:
        self._pending.append((self.group.send([tensor], self.rank + 1, tag), tensor))

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    # ---- teardown ------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the process group at once. Sends still outstanding (a failed step's, which
        the next rank never received) are dropped with it, not waited for."""
        if self._owns_default_group and dist.is_initialized():
            dist.destroy_process_group()  # tears down the pairs before the buffers go
        self._pending.clear()
        self._posted = self._out = None
        self.group = self.feedback_group = None
