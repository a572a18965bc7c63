"""The stage as a Ray actor: a thin shell around StageRunner that speaks msgpack bytes.

Created by the driver (which owns it: the stage dies with its driver), one per
placement-group bundle. Typed methods only; no dispatch by method-name string.
"""
from __future__ import annotations

from typing import Callable, Optional

from ray_runtime.config import EngineConfig
from ray_runtime.messages import decode_plan, encode
from stages.runner import StageRunner
from stages.transport import pick_rendezvous_address


class StageWorker:
    def __init__(self, config: EngineConfig, rank: int, layer_range: tuple[int, int],
                 max_model_len: int) -> None:
        self.runner = StageRunner(config, rank, layer_range, max_model_len)

    def node_info(self) -> dict:
        import os

        import ray

        ctx = ray.get_runtime_context()
        return {"rank": self.runner.rank, "node_id": ctx.get_node_id(), "pid": os.getpid(),
                "layers": list(self.runner.model.layer_range)}

    def rendezvous_address(self) -> tuple[str, int]:
        return pick_rendezvous_address()

    def init_transport(self, host: str, port: int) -> None:
        self.runner.init_transport(host, port)

    def kv_block_capacity(self) -> int:
        return self.runner.kv_block_capacity()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks)

    def execute(self, plan_bytes: bytes) -> bytes:
        return encode(self.runner.execute(decode_plan(plan_bytes)))

    def check(self) -> None:
        self.runner.check()

    def set_fault_hook(self, hook: Optional[Callable]) -> None:
        """Tests only: corrupt this rank's batch after a plan is applied."""
        self.runner.fault_hook = hook

    def close(self) -> None:
        self.runner.close()
