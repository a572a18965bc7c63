"""Run by tests/e2e/test_metrics_prometheus.py in its own process (a Python with Ray's
dashboard extras, which serve the export port): start a private Ray instance with a metrics
export port, run a PP=2 engine, scrape `http://127.0.0.1:<port>/metrics` during and after the
run, print one JSON line with what was scraped and the engine's stats(), shut Ray down.

    python tests/e2e/metrics_scrape_run.py MODEL_ROOT [DUMP_FILE]

With DUMP_FILE, each call has 48 requests, and the calls go on until a scrape shows output
tokens and requests running; that scrape is also written there as Prometheus text, our
`ray_ray_pp_*` lines only, Ray's own labels left out (docs/operations.md quotes one).
The KV pool is small on purpose, so that requests are preempted and the preemption counter
has something to agree on.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
# Export every second (Ray's default is 10 s), in every process this Ray instance starts.
os.environ["RAY_metrics_report_interval_ms"] = "1000"

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$')
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
OURS = "ray_ray_pp_"  # Ray's namespace + the sanitized prefix (ray_runtime/metrics.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, engine: str, raw: list | None = None) -> list:
    """[name, {labels without Ray's own}, value] of our engine's samples; with raw, our
    lines are also appended there as text, Ray's own labels left out."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = []
    for line in text.splitlines():
        if not line.startswith(OURS):
            continue
        m = SAMPLE.match(line)
        if not m:
            continue
        labels = dict(LABEL.findall(m.group(2) or ""))
        if labels.get("engine") != engine:
            continue
        keep = {k: v for k, v in labels.items()
                if k in ("model_name", "engine", "finished_reason", "pp_rank", "le")}
        out.append([m.group(1), keep, float(m.group(3))])
        if raw is not None:
            body = ",".join(f'{k}="{v}"' for k, v in sorted(keep.items()))
            raw.append(f"{m.group(1)}{{{body}}} {m.group(3)}")
    return out


def total(samples: list, name: str, **labels) -> float:
    return sum(v for n, ls, v in samples
               if n == name and all(ls.get(k) == str(x) for k, x in labels.items()))


def main() -> None:
    import ray

    from ray_runtime import LLM, SamplingParams
    from tests.tiny_models import make_tiny_model

    model = make_tiny_model("llama", sys.argv[1])
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="rpm", dir="/tmp")  # short: Ray's socket paths live here
    t0 = time.time()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=tmp,
             _metrics_export_port=port, runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    result = {"port": port}
    try:
        prompts = [[3 + (i * 7 + j) % 300 for j in range(10 + 3 * i)] for i in range(12)]
        budgets = [6 + 2 * (i % 5) for i in range(12)]
        dump = sys.argv[2] if len(sys.argv) > 2 else None
        if dump:  # calls long enough to span several flushes (0.5 s apart)
            prompts, budgets = prompts * 4, budgets * 4
        # 16 blocks of 16 tokens hold about 5 of these requests: the rest wait, and growing
        # decodes preempt.
        with LLM(model, pipeline_parallel_size=2, max_num_batched_tokens=32, num_kv_blocks=16,
                 max_model_len=256) as llm:
            engine = llm.info["engine_id"]
            during = []  # generation_tokens_total scraped while calls were running
            seen = threading.Event()
            rounds = []

            def run():  # calls until a scrape has seen the run (at most 60)
                while not seen.is_set() and len(rounds) < 60:
                    llm.generate([{"prompt_token_ids": p} for p in prompts],
                                 [SamplingParams(max_tokens=b, temperature=0, ignore_eos=True)
                                  for b in budgets])
                    rounds.append(1)

            th = threading.Thread(target=run)
            th.start()
            while th.is_alive():
                time.sleep(0.5)
                raw = []
                try:
                    now = scrape(port, engine, raw)
                except OSError:
                    continue
                during.append(total(now, OURS + "generation_tokens_total"))
                if dump and during[-1] > 0 and total(now, OURS + "num_requests_running") > 0:
                    with open(dump, "w") as f:
                        f.write("\n".join(raw) + "\n")
                    dump = None
                if during[-1] > 0 and not dump:  # with a dump: until one mid-call scrape
                    seen.set()
            th.join()
            stats = llm.stats()
            n = len(rounds) * len(prompts)
            # After the run, the engine still up (its driver exports every second): wait
            # until the last flush has been exported.
            deadline = time.time() + 40
            samples = []
            while time.time() < deadline:
                samples = scrape(port, engine)
                if total(samples, OURS + "generation_tokens_total") == \
                        stats["num_generated_tokens"] and \
                        total(samples, OURS + "request_success_total") == n:
                    break
                time.sleep(1)
        result.update(engine=engine, stats=stats, during=during, samples=samples,
                      num_requests=n, num_prompt_tokens=len(rounds) * sum(map(len, prompts)),
                      seconds=time.time() - t0)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
