"""Activations between neighbouring stages over torch.distributed point-to-point:
gloo on CPU, NCCL on GPU. The rendezvous port is chosen by the OS on rank 0's node and handed
to the other ranks by the driver; nothing is hard-coded."""
from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def pick_rendezvous_address() -> tuple[str, int]:
    """This node's address and a port the OS just proved free."""
    import ray

    host = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return host, s.getsockname()[1]


class StageTransport:
    def __init__(self, rank: int, world_size: int, device: str, host: str, port: int,
                 timeout_s: float = 600.0) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        self._pending = None

    def recv_from_prev(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        buf = torch.empty((num_tokens, hidden_size), dtype=dtype, device=self.device)
        dist.recv(buf, src=self.rank - 1)
        return buf

    def send_to_next(self, hidden: torch.Tensor) -> None:
        """Non-blocking: the stage goes on to its next plan while this one travels. At most
        one send is outstanding; its tensor is kept alive until it completes."""
        self.wait_sends()
        tensor = hidden.contiguous()
        self._pending = (dist.isend(tensor, dst=self.rank + 1), tensor)

    def wait_sends(self) -> None:
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    def close(self) -> None:
        self.wait_sends()
        if dist.is_initialized():
            dist.destroy_process_group()
