"""Run by tests/e2e/test_two_nodes.py in a process of its own (the test session has already
called ray.init): a Ray cluster of two nodes on this machine (ray.cluster_utils.Cluster, as
Ray's own tests make one), a PP=2 engine with one stage on each, and a report on stdout:
the outputs' token ids and stats()["stage_placement"]."""
import json
import sys

import ray
from ray.cluster_utils import Cluster

from ray_runtime import LLM, SamplingParams

if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address,
                 runtime_env={"env_vars": {"PYTHONPATH": args["pythonpath"], "OMP_NUM_THREADS": "1"}})
        with LLM(args["model"], pipeline_parallel_size=2, placement_strategy=args["strategy"],
                 num_kv_blocks=32, max_model_len=128, max_num_batched_tokens=32) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]],
                                SamplingParams(max_tokens=args["max_tokens"], temperature=0.0,
                                               ignore_eos=True))
            stats = llm.stats()
        report = {"token_ids": [o.outputs[0].token_ids for o in outs],
                  "stage_placement": stats["stage_placement"],
                  "nodes": [n["NodeID"] for n in ray.nodes() if n["Alive"]],
                  "bookkeeping_mismatches": stats["bookkeeping_mismatches"]}
        print("REPORT " + json.dumps(report), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
