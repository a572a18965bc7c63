"""The driver actor: places the stage actors, opens a channel to each, and runs the engine
core (ray_runtime/engine_core.py) continuously in its loop thread (ray_runtime/engine_loop.py).

It is a threaded actor: requests and aborts arrive at any time from any caller; one consumer
long-polls `get_outputs`; stats() and health() answer while a step runs. No Ray call and no
`ray.get` sits in the step loop: plans and replies travel over the channels.
"""
from __future__ import annotations

import logging
import uuid
from typing import Optional

import ray
from ray.util.placement_group import remove_placement_group

from ray_runtime.cluster import create_placement_group, open_channels, start_stages
from ray_runtime.config import EngineConfig
from ray_runtime.layer_span import stage_blocks
from ray_runtime.engine_core import EngineCore
from ray_runtime.engine_loop import EngineLoop
from ray_runtime.gc_pauses import GcPauses, settle_heap
from ray_runtime.link import reset_link
from ray_runtime.messages import RequestDelta, RequestSpec
from ray_runtime.ranks import ChannelRanks
from stages.model_spec import ModelSpec

logger = logging.getLogger(__name__)
DRIVER_MAX_CONCURRENCY = 64  # actor threads: callers adding, aborting, polling, asking stats


def resolve_max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    if config.max_model_len is None:
        return spec.max_position_embeddings
    if config.max_model_len > spec.max_position_embeddings:
        raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's "
                         f"max_position_embeddings ({spec.max_position_embeddings})")
    return config.max_model_len


class Driver:
    def __init__(self, config: EngineConfig, engine_id: Optional[str] = None) -> None:
        logging.basicConfig(level=logging.INFO)
        self.config = config
        # Names the actors (ray_runtime/cluster.py) and tags the metrics.
        self.engine_id = engine_id or uuid.uuid4().hex[:8]
        self.spec = ModelSpec.from_dir(config.model)
        self.max_model_len = resolve_max_model_len(config, self.spec)
        self.blocks = stage_blocks(self.spec.num_layers, config.pipeline_parallel_size,
                                   config.pp_layer_partition, config.pp_prefill_partition,
                                   self.spec.attention_share)
        self.num_kv_blocks: Optional[int] = None
        ranks = self._start_ranks()
        self.core = EngineCore(config, ranks, num_kv_blocks=self.num_kv_blocks,
                               max_model_len=self.max_model_len,
                               eos_token_ids=self.spec.eos_token_ids, engine_id=self.engine_id,
                               replace_ranks=self._replace_ranks,
                               reset_link=lambda: reset_link(self.stages, config, None))
        # The start-up heap frozen and collections timed (ray_runtime/gc_pauses.py): a
        # collection here stops planning, and every stage starves with it.
        settle_heap()
        self.gc = GcPauses(on_pause=lambda t0, t1, gen: self.core.trace.driver_span(
            "gc", t0, t1, generation=gen))
        self.loop = EngineLoop(self.core, on_idle=self._write_trace)

    def __repr__(self) -> str:
        """Ray shows it on the dashboard's Actors page and before this actor's log lines."""
        c = getattr(self, "config", None)
        if c is None:
            return "Driver()"
        return f"Driver(engine={self.engine_id}, pp={c.pipeline_parallel_size}, model={c.model})"

    def _start_ranks(self) -> ChannelRanks:
        """Place the stages, load their layers, size (first time) and allocate the KV pool,
        and open a channel to each."""
        config = self.config
        self.pg = create_placement_group(config)
        self.stages, self.stage_placement = start_stages(
            config, self.pg, self.blocks, self.max_model_len, engine_id=self.engine_id)
        if self.num_kv_blocks is None:
            self.num_kv_blocks = self._size_kv_pool()
        ray.get([s.init_kv_cache.remote(self.num_kv_blocks) for s in self.stages])
        return ChannelRanks(open_channels(self.stages), config.step_timeout_s)

    def _replace_ranks(self, error: BaseException) -> ChannelRanks:
        """Stage recovery (in the loop thread): every stage actor and the placement group go
        (the lost one may be dead, stalled or on a dead node; the survivors' link and KV are
        useless without it), and a new set is placed, loaded and connected. Ray places the
        new bundles wherever resources are, waiting up to placement_timeout_s."""
        self.core.ranks.abandon()
        self._stop_stages(graceful=False)
        return self._start_ranks()

    def _stop_stages(self, graceful: bool) -> None:
        try:
            if graceful:
                ray.get([s.close.remote() for s in self.stages], timeout=30)
        finally:
            for s in self.stages:
                try:
                    ray.kill(s)
                except Exception:  # noqa: BLE001 - already dead
                    pass
            remove_placement_group(self.pg)

    def _size_kv_pool(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        useful = self.config.max_num_seqs * -(-self.max_model_len // self.config.block_size)
        capacity = min(ray.get([s.kv_block_capacity.remote() for s in self.stages]))
        return max(1, min(capacity, useful))

    def _write_trace(self) -> None:
        if self.config.trace_file:
            self.core.trace.write(self.config.trace_file)

    def info(self) -> dict:
        return {"vocab_size": self.spec.vocab_size, "max_model_len": self.max_model_len,
                "num_kv_blocks": self.num_kv_blocks, "block_size": self.config.block_size,
                "eos_token_ids": list(self.spec.eos_token_ids),
                "num_layers": self.spec.num_layers, "engine_id": self.engine_id}

    # ---- serving -------------------------------------------------------------------------
    def add_requests(self, requests: list[RequestSpec]) -> None:
        self.loop.add_requests(requests)

    def abort(self, req_ids: list[str]) -> None:
        self.loop.abort(req_ids)

    def get_outputs(self, ack: int, timeout_s: float = 1.0) -> tuple[int, list[RequestDelta]]:
        """Deltas after batch `ack`, and the batch number to acknowledge next (engine_loop.py)."""
        return self.loop.get_outputs(ack, timeout_s)

    def health(self) -> dict:
        return self.loop.health()

    # ---- engine --------------------------------------------------------------------------
    def stats(self) -> dict:
        out = self.core.stats()
        # where each stage runs: rank, layers, node id and address, pid, GPU ids
        out["stage_placement"] = [dict(p) for p in self.stage_placement]
        gc_totals = self.gc.snapshot()  # the collections since the engine settled its heap
        out["driver_gc_s"], out["driver_gc_max_s"] = gc_totals["total_s"], gc_totals["max_s"]
        out["driver_gc"] = gc_totals
        return out

    def metrics_snapshot(self) -> Optional[dict]:
        """Tests only: what the metrics recorded (ray_runtime/metrics.py, snapshot()), or
        None with disable_log_stats."""
        m = self.core.metrics
        return None if m is None else self.loop.call(lambda core: m.snapshot())

    def check(self) -> None:
        """Every invariant, in the loop thread between two steps: the scheduler's and, when no
        step is in flight, each rank's and that every rank holds a slot for exactly the
        driver's view."""
        def check_all(core):
            core.scheduler.check()
            view = core.rank_view()
            if view is None:  # steps in flight: a stage may be mid-step, its batch changing
                return
            ray.get([s.check.remote() for s in self.stages])
            for rank, held in enumerate(ray.get([s.live_req_ids.remote() for s in self.stages])):
                if set(held) != view:
                    raise AssertionError(
                        f"rank {rank} holds slots for {sorted(set(held) - view)} that the "
                        f"driver does not expect, and lacks {sorted(view - set(held))}")

        self.loop.call(check_all)

    def set_fault_hook(self, rank: int, hook) -> None:
        self.loop.call(lambda core: ray.get(self.stages[rank].set_fault_hook.remote(hook)))

    def shutdown(self) -> None:
        self.loop.stop()
        self.gc.close()
        self._write_trace()
        if self.core.metrics is not None:
            self.core.metrics.close()
        self.core.ranks.close()
        self._stop_stages(graceful=True)
