"""The inter-stage link (the activation transport between neighbouring stages,
stages/transport.py), seen from the driver: forming it when the stages start, and resetting
it after a failed step.

A failed step leaves the link out of step: a stage that failed before it received its
activations leaves them queued for its next step, and its neighbour's send outstanding.
Step tags catch that (the next transfer is refused, naming both steps), but only a reset makes
the next call correct: every stage leaves its process group, dropping whatever is in flight,
rank 0 opens a fresh rendezvous store (a new OS-chosen port on its node's address), and every
stage joins it. The driver resets only once every stage has answered every plan it was sent,
so no step is running on any stage meanwhile.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import ray

from ray_runtime.config import EngineConfig

logger = logging.getLogger(__name__)
LINK_TIMEOUT_S = 30.0  # forming or resetting the link (~50 ms on one node): past this, unusable


def form_link(stages: list, config: EngineConfig, timeout_s: float = LINK_TIMEOUT_S) -> None:
    """Wire the stages' process group: rank 0 opens the rendezvous store on its node's
    address, and every stage joins it (all at once: each returns when all have joined)."""
    if config.pipeline_parallel_size == 1:
        return
    host, port = ray.get(stages[0].rendezvous_address.remote(), timeout=timeout_s)
    ray.get([s.init_transport.remote(host, port) for s in stages], timeout=timeout_s)


def reset_link(stages: list, config: EngineConfig, broken: Optional[str],
               timeout_s: float = LINK_TIMEOUT_S) -> Optional[str]:
    """After a failed call: tear the link down on every stage and form it again. Returns why
    the engine cannot run any more: `broken` as given (an engine that lost track of its
    stages is not touched), or why the reset failed, or None when the link is fresh."""
    if broken is not None or config.pipeline_parallel_size == 1:
        return broken
    t0 = time.monotonic()
    try:
        ray.get([s.close_transport.remote() for s in stages], timeout=timeout_s)
        form_link(stages, config, timeout_s)
    except (ray.exceptions.RayError, OSError) as e:  # GetTimeoutError is a RayError
        logger.error("the inter-stage link could not be reset: %s: %s", type(e).__name__, e)
        return f"the inter-stage link could not be reset after a failed step: {type(e).__name__}: {e}"
    logger.info("inter-stage link reset in %.3fs", time.monotonic() - t0)
    return None
