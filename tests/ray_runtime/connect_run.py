"""Run by tests/ray_runtime/test_connect.py in a process of its own (the test session has
already called ray.init): connect_ray with the given address, then report which cluster it
joined and whether a PP=2 and a PP=3 engine's bundles place there side by side."""
import json
import logging
import sys

import ray
from ray.util.placement_group import placement_group

from ray_runtime.cluster import connect_ray
from ray_runtime.config import EngineConfig

if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO)
    joined = connect_ray(EngineConfig(model="unused", pipeline_parallel_size=2,
                                      address=args.get("address")))
    report = {"joined": joined, "gcs_address": ray.get_runtime_context().gcs_address,
              "cpus": ray.cluster_resources().get("CPU", 0)}
    if args.get("place"):
        groups = [placement_group([{"CPU": 1}] * pp) for pp in (2, 3)]
        ready, _ = ray.wait([g.ready() for g in groups], num_returns=2, timeout=30)
        report["placed"] = len(ready)
    ray.shutdown()
    print("REPORT " + json.dumps(report))
