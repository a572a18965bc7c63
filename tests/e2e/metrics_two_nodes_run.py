"""Run by tests/e2e/test_metrics_two_nodes.py in a process of its own (the test session has
already called ray.init): two Ray nodes on this machine (ray.cluster_utils.Cluster), each
with a metrics export port, a PP=2 engine placed STRICT_SPREAD, and every node's export
port (from ray.nodes(), as Prometheus' service discovery finds them) scraped:

1. before any request: until every counter and gauge series of the engine is there
   (issue 19), or 30 s;
2. after a short run with no preemptions, once the run's tokens are exported;
3. while the engine sits idle for more than two report intervals (Ray 2.60 evicts a gauge
   left unset that long; the engine's keep-alive sets them again).

Prints one line, REPORT + JSON: per phase, each port's samples of this engine.

    python -m tests.e2e.metrics_two_nodes_run '{"model": ..., "pythonpath": ...}'
"""
from __future__ import annotations

import json
import os
import sys
import time

# Export every second (Ray's default is 10 s): set before the nodes start, so that every
# process of the cluster (the raylets, their agents, the driver actor) inherits it.
os.environ["RAY_metrics_report_interval_ms"] = "1000"

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from ray_runtime import LLM, SamplingParams  # noqa: E402
from tests.e2e.metrics_scrape_run import OURS, free_port, scrape  # noqa: E402
from tests.e2e.metrics_series import expected_series  # noqa: E402


def key(sample) -> tuple:
    name, labels, _ = sample
    return name, tuple(sorted((k, v) for k, v in labels.items()
                              if k not in ("model_name", "engine", "le")))


def scrape_all(ports: list[int], engine: str) -> dict:
    out = {}
    for p in ports:
        try:
            out[str(p)] = scrape(p, engine)
        except OSError as e:
            out[str(p)] = {"error": repr(e)}
    return out


def present(by_port: dict) -> set:
    return {key(s) for samples in by_port.values() if isinstance(samples, list)
            for s in samples}


def value(by_port: dict, name: str, **labels) -> float:
    return sum(v for samples in by_port.values() if isinstance(samples, list)
               for n, ls, v in samples
               if n == OURS + name and all(ls.get(k) == str(x) for k, x in labels.items()))


def log(msg: str) -> None:
    print(f"[metrics_two_nodes_run {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr,
          flush=True)


def main() -> None:
    args = json.loads(sys.argv[1])
    env_vars = {"PYTHONPATH": args["pythonpath"], "OMP_NUM_THREADS": "1"}
    ports = [free_port(), free_port()]
    while ports[1] == ports[0]:
        ports[1] = free_port()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "metrics_export_port": ports[0]})
    report: dict = {"ports": ports}
    try:
        cluster.add_node(num_cpus=1, metrics_export_port=ports[1])
        cluster.wait_for_nodes()
        log("two nodes up")
        ray.init(address=cluster.address, runtime_env={"env_vars": env_vars})
        nodes = [n for n in ray.nodes() if n["Alive"]]
        report["nodes"] = [{"node_id": n["NodeID"], "metrics_export_port": n["MetricsExportPort"]}
                           for n in nodes]
        scrape_ports = sorted(n["MetricsExportPort"] for n in nodes)
        want = set(expected_series(2))
        t0 = time.time()
        with LLM(args["model"], pipeline_parallel_size=2, placement_strategy="STRICT_SPREAD",
                 num_kv_blocks=32, max_model_len=128, max_num_batched_tokens=32) as llm:
            engine = llm.info["engine_id"]
            report["engine"] = engine
            report["engine_start_s"] = time.time() - t0
            log(f"engine {engine} started; scraping ports {scrape_ports}")
            # 1. Before any request.
            t1 = time.time()
            before = {}
            while time.time() - t1 < 30:
                before = scrape_all(scrape_ports, engine)
                if want <= present(before):
                    break
                time.sleep(0.5)
            report["before_s"] = time.time() - t1
            log(f"before any request: {len(want & present(before))}/{len(want)} series "
                f"after {report['before_s']:.1f} s")
            report["before"] = before
            report["stats_before"] = llm.stats()
            # 2. A short run, no preemptions (a KV pool far larger than it needs).
            outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]},
                                 {"prompt_token_ids": [9, 10, 11]}],
                                SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            stats = llm.stats()
            report["stats"] = stats
            report["num_outputs"] = len(outs)
            log("generated")
            t2 = time.time()
            after = {}
            while time.time() - t2 < 30:
                after = scrape_all(scrape_ports, engine)
                if value(after, "generation_tokens_total") == stats["num_generated_tokens"] and \
                        value(after, "request_success_total") == len(outs):
                    break
                time.sleep(0.5)
            report["after"] = after
            # 3. Idle past the gauges' eviction (two report intervals = 2 s): scrapes at
            # 1.5 s to 4.5 s after the run must still show every gauge series.
            idle = []
            for _ in range(4):
                time.sleep(1.5 if not idle else 1.0)
                idle.append(scrape_all(scrape_ports, engine))
            report["idle"] = idle
            log("idle scrapes done")
        report["seconds"] = time.time() - t0
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
