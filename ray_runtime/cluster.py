"""Placing the stages: one placement-group bundle per stage, rank r in bundle r, and the
inter-stage process group wired with an OS-chosen port."""
from __future__ import annotations

import logging
import math
import os

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_runtime.config import EngineConfig

logger = logging.getLogger(__name__)


def driver_actor_name(engine_id: str) -> str:
    """The driver actor's name, as `ray list actors` and the dashboard show it."""
    return f"ray_pp-{engine_id}-driver"


def stage_actor_name(engine_id: str, rank: int, pp_size: int, layer_range: tuple[int, int]) -> str:
    """A stage actor's name: engine, rank of how many, and its decoder layers (inclusive)."""
    return f"ray_pp-{engine_id}-stage{rank}of{pp_size}-layers{layer_range[0]}-{layer_range[1] - 1}"


def connect_ray(config: EngineConfig) -> None:
    """Join the cluster that is there (`ray job submit`, RAY_ADDRESS, a running local
    cluster); start a local one only when there is none."""
    if ray.is_initialized():
        return
    try:
        ray.init(address="auto")
    except (ConnectionError, RuntimeError):
        need = math.ceil(config.pipeline_parallel_size * config.num_cpus_per_stage)
        ray.init(num_cpus=max(os.cpu_count() or 1, need))


def stage_bundle(config: EngineConfig) -> dict:
    bundle = {"CPU": config.num_cpus_per_stage}
    if config.device == "cuda":
        bundle["GPU"] = 1
    return bundle


def create_placement_group(config: EngineConfig):
    bundles = [stage_bundle(config) for _ in range(config.pipeline_parallel_size)]
    pg = placement_group(bundles, strategy=config.placement_strategy)
    ready, _ = ray.wait([pg.ready()], timeout=config.placement_timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise RuntimeError(
            f"could not place {config.pipeline_parallel_size} pipeline stages of {bundles[0]} "
            f"each with strategy {config.placement_strategy} within "
            f"{config.placement_timeout_s:.0f}s: the cluster has {ray.cluster_resources()}. "
            "Run `ray status` to see free resources, add nodes, lower "
            "pipeline_parallel_size, or use placement_strategy='SPREAD'.")
    return pg


def start_stages(config: EngineConfig, pg, layer_ranges: list[tuple[int, int]],
                 max_model_len: int, engine_id: str = "") -> tuple[list, list[dict]]:
    """The stage actors in rank order, and where each runs (rank, layers, node id and
    address, pid, GPU ids)."""
    from stages.worker import StageWorker  # stages import ray_runtime's messages: no cycle at load

    remote_cls = ray.remote(StageWorker)
    stages = []
    for rank, layer_range in enumerate(layer_ranges):
        opts = dict(num_cpus=config.num_cpus_per_stage,
                    num_gpus=1 if config.device == "cuda" else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=rank))
        if engine_id:
            opts["name"] = stage_actor_name(engine_id, rank, len(layer_ranges), layer_range)
        stages.append(remote_cls.options(**opts).remote(config, rank, layer_range, max_model_len,
                                                        engine_id=engine_id))
    infos = ray.get([s.node_info.remote() for s in stages])
    for info in infos:
        logger.info("stage %d: layers %s on node %s (%s, pid %d, GPUs %s)", info["rank"],
                    info["layers"], info["node_id"][:8], info["node_ip"], info["pid"],
                    info["gpu_ids"] or "none")
    from ray_runtime.link import form_link  # the inter-stage process group: ray_runtime/link.py
    form_link(stages, config)
    return stages, infos


def open_channels(stages: list) -> list:
    """Start every stage's step loop and connect the driver's channel to each, in rank order."""
    from ray_runtime.channel import Channel

    addresses = ray.get([s.open_channel.remote() for s in stages])
    return [Channel.connect(host, port, peer=f"stage rank {rank} at {host}:{port}")
            for rank, (host, port) in enumerate(addresses)]
