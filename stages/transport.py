"""Activations between neighbouring stages over torch.distributed point-to-point: gloo on CPU,
NCCL on GPU (with gloo beside it for the headers). Rank 0 holds the rendezvous store, bound to
its node's address at a port the OS chose there; the driver hands that address to the other
ranks (ray_runtime/link.py). Nothing is hard-coded.

Every transfer is step-tagged. Before the activations of step k, the sender sends a header of
four int64s, (step id, status, num_tokens, hidden_size), as a host tensor on its own tag; the
receiver checks it against its own plan before it posts the payload's receive:

- another step's header, or another shape: the payload is received into a buffer of the
  header's shape (so the link stays aligned and no transport aborts on a size mismatch) and
  the step is refused with `StepMismatch`, naming both steps and both ranks;
- a failure header (the sender failed step k before it had activations to send): the step is
  refused with `UpstreamFailed` at once, instead of waiting for a timeout. A stage that fails
  a step sends one (`StageRunner.launch`), so a failure travels down the pipeline in
  milliseconds and every stage answers the driver.

After any failed step the driver resets the link (ray_runtime/link.py: every stage closes its
process group, rank 0 opens a fresh store, every stage joins it), which drops whatever the
failed steps left in flight.
"""
from __future__ import annotations

import logging
import socket
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

PAYLOAD_TAG, HEADER_TAG = 0, 1  # gloo matches by tag: a header never meets a payload's buffer
DATA, FAILED = 0, 1  # header status
HEADER_LEN = 4  # step_id, status, num_tokens, hidden_size
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
    """One rank's end of the link: receives from rank - 1, sends to rank + 1. `group` is a
    torch ProcessGroup whose ranks are the pipeline ranks (the default group in a stage;
    a bare ProcessGroupGloo in the unit tests)."""

    def __init__(self, rank: int, world_size: int, device: str, group,
                 owns_default_group: bool = False) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.group = group
        self._owns_default_group = owns_default_group
        self._pending: list = []  # (work, tensor) of the last step's sends, kept alive
        self.last_sent_step: Optional[int] = None  # the last step sent on (data or failure)

    @classmethod
    def connect(cls, rank: int, world_size: int, device: str, store,
                timeout_s: float) -> "StageTransport":
        """Join the stages' process group through `store`. timeout_s bounds every transfer
        (the engine's step_timeout_s): a stage waiting on a neighbour that never sends fails
        within it."""
        # Headers are host tensors: on GPU they travel over gloo, the activations over NCCL.
        backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        return cls(rank, world_size, device, dist.group.WORLD, owns_default_group=True)

    # ---- receiving -----------------------------------------------------------------------
    def recv_from_prev(self, step_id: int, num_tokens: int, hidden_size: int,
                       dtype: torch.dtype) -> torch.Tensor:
        src = self.rank - 1
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        self.group.recv([header], src, HEADER_TAG).wait()
        got_step, status, got_tokens, got_hidden = header.tolist()
        if status == FAILED:
            raise UpstreamFailed(f"rank {self.rank}: rank {src} failed step {got_step} and sent "
                                 f"no activations (this rank was at step {step_id})")
        if status != DATA:
            raise LinkError(f"rank {self.rank}: unknown header status {status} from rank {src}")
        buf = torch.empty((got_tokens, got_hidden), dtype=dtype, device=self.device)
        self.group.recv([buf], src, PAYLOAD_TAG).wait()  # received whole even when refused
        if (got_step, got_tokens, got_hidden) != (step_id, num_tokens, hidden_size):
            raise StepMismatch(
                f"rank {self.rank} expected step {step_id}'s activations ({num_tokens} tokens x "
                f"{hidden_size}) from rank {src}, but rank {src} sent step {got_step}'s "
                f"({got_tokens} tokens x {got_hidden}): the link is out of step; refused")
        return buf

    # ---- sending -------------------------------------------------------------------------
    def send_to_next(self, step_id: int, hidden: torch.Tensor) -> None:
        """Non-blocking: the stage goes on to its next plan while this one travels. At most
        one step's sends are outstanding; their tensors are kept alive until they complete."""
        self.wait_sends()
        tensor = hidden.contiguous()
        self._send_header(step_id, DATA, tensor.shape[0], tensor.shape[1])
        self._pending.append((self.group.send([tensor], self.rank + 1, PAYLOAD_TAG), tensor))

    def send_failure(self, step_id: int) -> None:
        """Tell the next rank that this one failed step_id, unless it already sent for it."""
        if self.last_sent_step == step_id:
            return
        self.wait_sends()
        self._send_header(step_id, FAILED, 0, 0)

    def _send_header(self, step_id: int, status: int, num_tokens: int, hidden: int) -> None:
        header = torch.tensor([step_id, status, num_tokens, hidden], dtype=torch.int64)
        self._pending.append((self.group.send([header], self.rank + 1, HEADER_TAG), header))
        self.last_sent_step = step_id

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
        self.group = None
