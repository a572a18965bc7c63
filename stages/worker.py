"""The stage as a Ray actor: a thin shell around StageRunner. Set-up and checks are actor
calls; steps travel over the channel to the stage's StepLoop thread, never as actor calls.

Created by the driver (which owns it: the stage dies with its driver), one per
placement-group bundle. Typed methods only; no dispatch by method-name string.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Optional

from ray_runtime.config import EngineConfig
from ray_runtime.gc_pauses import settle_heap
from ray_runtime.layer_span import LayerSpan, StageBlocks
from stages import profiling
from stages.runner import StageRunner
from stages.step_loop import StepLoop
from stages.transport import connect_rendezvous, open_rendezvous

logger = logging.getLogger(__name__)


def stage_log(rank: int, pp: int) -> logging.LoggerAdapter:
    """This stage's logger: every line names the rank that wrote it, and is written once
    (one handler of our own on "stages", not propagated to the root logger, whatever
    handlers Ray or a library put there)."""
    base = logging.getLogger("stages")
    if not base.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        base.addHandler(handler)
        base.setLevel(logging.INFO)
        base.propagate = False
    return _RankAdapter(logger, {"rank": f"stage rank {rank}/{pp}"})


class _RankAdapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return f"{self.extra['rank']}: {msg}", kwargs


def require_model_folder(model: str, rank: int) -> None:
    """Every node that hosts a stage loads its layers from `model`: a node without it is an
    error naming the node and the path, before any weight is read."""
    if os.path.isfile(os.path.join(model, "config.json")):
        return
    import ray

    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "?"
    ip = ray.util.get_node_ip_address() if ray.is_initialized() else "?"
    what = "no such folder" if not os.path.isdir(model) else "no config.json in it"
    raise FileNotFoundError(
        f"stage rank {rank}: the model folder {model!r} is missing on node {node} ({ip}): "
        f"{what}. Every node that hosts a stage loads its layers from the same path: put the "
        "checkpoint there on every node (shared storage or a copy).")


class StageWorker:
    def __init__(self, config: EngineConfig, rank: int, span: LayerSpan,
                 max_model_len: int, engine_id: str = "",
                 prefill_span: Optional[LayerSpan] = None) -> None:
        label = StageBlocks(span, prefill_span or span).label()
        self._desc = (f"rank={rank}/{config.pipeline_parallel_size}, "
                      f"layers={label}, engine={engine_id or '?'}")
        self.log = stage_log(rank, config.pipeline_parallel_size)
        require_model_folder(config.model, rank)
        profiling.prepare(config.device)
        self.runner = StageRunner(config, rank, span, max_model_len, prefill_span=prefill_span)
        self.log.info("layers %s of %s loaded (pid %d)", label,
                      config.model, os.getpid())
        self.loop: Optional[StepLoop] = None
        self._store = None  # rank 0: the rendezvous store opened for the next init_transport
        self._rendezvous: Optional[tuple[str, int]] = None  # rank 0: where it listens

    def __repr__(self) -> str:
        """Ray shows it on the dashboard's Actors page and before this actor's log lines."""
        return f"StageWorker({getattr(self, '_desc', '')})"

    def node_info(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        return {"rank": self.runner.rank, "node_id": ctx.get_node_id(),
                "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "layers": self.runner.model.span.bounds,
                "prefill_layers": self.runner.model.prefill_span.bounds}

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0: open a fresh rendezvous store for the link, listening on this node's
        address only, and return where it listens (ray_runtime/link.py hands it on)."""
        import ray

        host = ray.util.get_node_ip_address()
        self._store, port = open_rendezvous(host)
        self._rendezvous = (host, port)
        return host, port

    def init_transport(self, host: str, port: int) -> None:
        """Join the link through rank 0's store (rank 0 through its own); every rank is
        called at once, and each returns when all have joined."""
        store = self._store if self.runner.rank == 0 else connect_rendezvous(host, port)
        self._store = None  # the process group keeps what it needs
        with profiling.sync_allowed():  # forming the link waits for its first message
            self.runner.init_transport(store)

    def close_transport(self) -> None:
        """Leave the link (the driver resets it after a failed step; no step is running)."""
        with profiling.sync_allowed():
            self.runner.close_transport()

    def link_info(self) -> dict:
        """Tests: how many times this rank has joined the link, and (rank 0) where its
        latest rendezvous store listens."""
        return {"generation": self.runner.link_generation, "rendezvous": self._rendezvous}

    def steps_by_split(self) -> dict:
        """How many steps this rank ran on each split's blocks (ray_runtime/layer_span.py):
        the prefill split's as its model counted them."""
        prefill = self.runner.model.num_prefill_split_runs
        return {"decode": self.runner.num_steps_run - prefill, "prefill": prefill}

    def kv_block_capacity(self) -> int:
        return self.runner.kv_block_capacity()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks)

    def open_channel(self) -> tuple[str, int]:
        """Start the step loop; it waits for the driver at the returned address (this node's
        address, an OS-chosen port)."""
        import ray

        settle_heap()  # the loaded model's heap frozen before the first step (gc_pauses.py)
        self.loop = StepLoop(self.runner, ray.util.get_node_ip_address())
        return self.loop.address

    def check(self) -> None:
        with profiling.sync_allowed():  # reads the device's block table back
            self.runner.check()

    def live_req_ids(self) -> list[str]:
        """The requests this rank holds a slot for (the driver's check compares them)."""
        return list(self.runner.batch.req_id_to_slot)

    def set_fault_hook(self, hook: Optional[Callable]) -> None:
        """Tests only: corrupt this rank's batch after a plan is applied."""
        self.runner.fault_hook = hook

    def close(self) -> None:
        if self.loop is not None and not self.loop.join(timeout_s=30.0):
            raise RuntimeError(f"stage rank {self.runner.rank}: step loop did not stop")
        self.runner.close()
