"""Placing the stages: one placement-group bundle per stage, rank r in bundle r, and the
inter-stage process group wired with an OS-chosen port."""
from __future__ import annotations

import logging
import math
import os
from typing import Optional

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_runtime.config import EngineConfig
from ray_runtime.layer_span import StageBlocks

logger = logging.getLogger(__name__)


def driver_actor_name(engine_id: str) -> str:
    """The driver actor's name, as `ray list actors` and the dashboard show it."""
    return f"ray_pp-{engine_id}-driver"


def stage_actor_name(engine_id: str, rank: int, pp_size: int, blocks: StageBlocks) -> str:
    """A stage actor's name: engine, rank of how many, and its decoder layers (inclusive;
    LayerSpan.label of the decode split's: the partition as given)."""
    return f"ray_pp-{engine_id}-stage{rank}of{pp_size}-layers{blocks.decode.label()}"


# A private local cluster's logical CPUs: room for several engines, or a later one of a larger
# PP size, in the same process (the first engine fixes the size). Only Ray's scheduling
# counts them; each stage runs torch on torch_threads_per_stage threads whatever the count.
LOCAL_CLUSTER_MIN_CPUS = 16


class PlacementInfeasible(ValueError):
    """The cluster can never hold the stages as asked (too few resources or nodes in total),
    raised before any placement group waits. A ValueError: the CLI exits 2 with it."""


def connect_ray(config: EngineConfig) -> str:
    """Join only the cluster named, else start a private local one; then check that the
    stages can ever be placed there (`check_cluster_fits`). Returns which it did, as logged.

    The cluster named: `config.address` (the `address=` keyword, the CLI's `--address`;
    "auto" means the `ray start` cluster on this machine), else the RAY_ADDRESS environment
    variable (`ray job submit` sets it for its entrypoint). A process that already called
    `ray.init` keeps its cluster. Never `address="auto"` by default: that joins any cluster
    found on the machine, another user's included."""
    if ray.is_initialized():
        joined = f"using the Ray cluster this process already joined ({_gcs_address()})"
        if config.address:
            logger.warning("address=%r is ignored: %s", config.address, joined)
    else:
        address = config.address or os.environ.get("RAY_ADDRESS") or None
        if address:
            ray.init(address=address)
            source = "address" if config.address else "RAY_ADDRESS"
            joined = f"joined the Ray cluster at {_gcs_address()} ({source}={address!r})"
        else:
            need = math.ceil(config.pipeline_parallel_size * config.num_cpus_per_stage)
            num_cpus = max(os.cpu_count() or 1, need, LOCAL_CLUSTER_MIN_CPUS)
            ray.init(address="local", num_cpus=num_cpus)
            joined = (f"started a private local Ray cluster ({num_cpus} logical CPUs); to use "
                      "another, pass address= (--address) or set RAY_ADDRESS")
    logger.info("%s", joined)
    check_cluster_fits(config)
    return joined


def _gcs_address() -> str:
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - only for the log line
        return "?"


def stage_bundle(config: EngineConfig) -> dict:
    bundle = {"CPU": config.num_cpus_per_stage}
    if config.device == "cuda":
        bundle["GPU"] = 1
    return bundle


def _fits(node: dict, bundle: dict) -> int:
    """How many copies of `bundle` one node's total resources hold."""
    counts = [math.floor(node.get(k, 0.0) / v + 1e-9) for k, v in bundle.items() if v > 0]
    return min(counts) if counts else 0


def _fmt(resources: dict) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(resources.items()))


def placement_shortfall(pp: int, bundle: dict, strategy: str,
                        nodes: dict[str, dict]) -> Optional[str]:
    """Why `pp` bundles can never be placed with `strategy` on nodes of these total resources
    ({node id: {resource: amount}}), or None when they can. Pure: unit-tested without Ray."""
    per_node = {nid: _fits(res, bundle) for nid, res in nodes.items()}
    totals: dict[str, float] = {}
    for res in nodes.values():
        for k in bundle:
            totals[k] = totals.get(k, 0.0) + res.get(k, 0.0)
    needed = {k: v * pp for k, v in bundle.items() if v > 0}
    fit_anyhow = sum(per_node.values())
    layout = "; ".join(f"node {nid[:8]}: {_fmt({k: res.get(k, 0.0) for k in bundle})}"
                       for nid, res in nodes.items()) or "no node"
    head = (f"pipeline_parallel_size={pp} needs {pp} stage bundles of {{{_fmt(bundle)}}} "
            f"({_fmt(needed)} in all), ")
    if fit_anyhow < pp:
        short = [k for k in needed if totals.get(k, 0.0) < needed[k]]
        why = (f"but the cluster has {_fmt(totals)} in total on {len(nodes)} node(s)" if short
               else f"but a bundle must fit on one node and the cluster's nodes hold only "
                    f"{fit_anyhow}")
        advice = ["lower --pipeline-parallel-size (pipeline_parallel_size=)"]
        if "CPU" in short or (not short and bundle.get("CPU", 0) > 0):
            advice.append("lower --num-cpus-per-stage (num_cpus_per_stage=)")
        advice.append("or add nodes to the cluster (`ray status` shows what it has)")
        return f"{head}{why} ({layout}). To fit: {', '.join(advice)}."
    if strategy == "STRICT_SPREAD":
        hosts = sum(1 for n in per_node.values() if n > 0)
        if hosts < pp:
            return (f"{head}and placement strategy STRICT_SPREAD puts each on its own node, but "
                    f"only {hosts} of the cluster's {len(nodes)} node(s) can host one ({layout}). "
                    "To fit: --placement-strategy SPREAD or PACK (placement_strategy=) to let "
                    "stages share a node, lower --pipeline-parallel-size, or add nodes.")
    if strategy == "STRICT_PACK":
        best = max(per_node.values(), default=0)
        if best < pp:
            return (f"{head}and placement strategy STRICT_PACK puts all on one node, but the "
                    f"largest node holds only {best} ({layout}). To fit: --placement-strategy "
                    "PACK or SPREAD (placement_strategy=) to use several nodes, or lower "
                    "--pipeline-parallel-size.")
    return None


def cluster_node_resources() -> dict[str, dict]:
    """Each alive node's total resources: {node id: {resource: amount}}."""
    return {n["NodeID"]: dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")}


def autoscaler_node_resources() -> Optional[dict[str, dict]]:
    """The nodes an autoscaler may bring up, at most (its node groups' resources times their
    max count), or None when the cluster has no autoscaler config (or an unbounded one)."""
    try:
        from ray._private.state import state

        cfg = state.get_cluster_config()
    except Exception:  # noqa: BLE001 - a private API: no config known means no autoscaler
        return None
    if cfg is None or not cfg.node_group_configs:
        return None
    nodes = {}
    for g in cfg.node_group_configs:
        if g.max_count < 0:
            return None
        for i in range(min(g.max_count, 1024)):
            nodes[f"{g.name}-{i}"] = dict(g.resources)
    return nodes


def check_cluster_fits(config: EngineConfig) -> None:
    """Fail at once, with the numbers and the flags to change, when the cluster can never
    hold the stages (nor can its autoscaler grow it to); resources that exist but are busy
    now are left to the placement group's wait (`create_placement_group`)."""
    bundle = stage_bundle(config)
    pp, strategy = config.pipeline_parallel_size, config.placement_strategy
    why = placement_shortfall(pp, bundle, strategy, cluster_node_resources())
    if why is None:
        return
    scaled = autoscaler_node_resources()
    if scaled is not None and placement_shortfall(pp, bundle, strategy, scaled) is None:
        logger.info("the cluster cannot hold the stages now; its autoscaler may add nodes: %s",
                    why)
        return
    raise PlacementInfeasible(why)


def create_placement_group(config: EngineConfig):
    check_cluster_fits(config)
    bundles = [stage_bundle(config) for _ in range(config.pipeline_parallel_size)]
    pg = placement_group(bundles, strategy=config.placement_strategy)
    ready, _ = ray.wait([pg.ready()], timeout=config.placement_timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise RuntimeError(
            f"could not place {config.pipeline_parallel_size} pipeline stages of "
            f"{{{_fmt(bundles[0])}}} each with placement strategy {config.placement_strategy} "
            f"within placement_timeout_s={config.placement_timeout_s:g}: the cluster has "
            f"{_fmt(ray.cluster_resources())} in total, enough for them, but only "
            f"{_fmt(ray.available_resources())} free now (other jobs or engines hold the "
            "rest). Run `ray status` to see who holds what; stop them, wait, or raise "
            "placement_timeout_s.")
    return pg


def start_stages(config: EngineConfig, pg, spans: list[StageBlocks],
                 max_model_len: int, engine_id: str = "") -> tuple[list, list[dict]]:
    """The stage actors in rank order, and where each runs (rank, layers, node id and
    address, pid, GPU ids)."""
    from stages.worker import StageWorker  # stages import ray_runtime's messages: no cycle at load

    remote_cls = ray.remote(StageWorker)
    stages = []
    for rank, span in enumerate(spans):
        opts = dict(num_cpus=config.num_cpus_per_stage,
                    num_gpus=1 if config.device == "cuda" else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=rank))
        if engine_id:
            opts["name"] = stage_actor_name(engine_id, rank, len(spans), span)
        stages.append(remote_cls.options(**opts).remote(config, rank, span.decode, max_model_len,
                                                        engine_id=engine_id,
                                                        prefill_span=span.prefill))
    infos = []
    for rank, stage in enumerate(stages):
        try:
            infos.append(ray.get(stage.node_info.remote()))
        except ray.exceptions.RayActorError as e:
            # The stage's own error (a node without the model folder, out of memory) is
            # what to show: the last line of the actor-died text around its traceback.
            text = getattr(e, "error_msg", None) or str(e)
            cause = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), text)
            for s in stages:
                ray.kill(s)
            raise RuntimeError(f"stage rank {rank} did not start: {cause}") from None
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
