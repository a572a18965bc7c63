"""Stage idle fractions and throughput, sync vs async (and at PP>1 async without token
feedback: each token through the driver), at several PP depths, from the pipeline trace's
own accounting (stats()["stage_idle_fraction"]).

  python bench/pipeline_idle.py [--pp 1 2 4] [--requests 64] [--max-tokens 32]
      [--modes sync async async_no_feedback] [--hidden 256 --layers 8] [--device cpu]
      [--dtype float32] [--max-num-seqs N] [--trace-dir DIR] [--tag NAME]

Idle = waiting for the previous stage's activations + gaps between steps, over busy + idle.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import idle_fractions_between, save, tiny_llama  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[32, 128])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="default: every request at once; below --requests the rest queue")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model-dir", default="/tmp/ray_runtime_bench/llama_idle")
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--modes", nargs="+", default=["sync", "async", "async_no_feedback"],
                   choices=["sync", "async", "async_no_feedback"])
    p.add_argument("--tag", default=None, help="results file pipeline_idle_<tag>.json")
    args = p.parse_args()

    import ray

    from ray_runtime import LLM, SamplingParams
    from ray_runtime.config import EngineConfig

    model = tiny_llama(f"{args.model_dir}_{args.hidden}x{args.layers}", hidden=args.hidden,
                       layers=args.layers, heads=max(1, args.hidden // 64),
                       kv_heads=max(1, args.hidden // 128), intermediate=args.hidden * 3,
                       vocab=4096)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 4096) for _ in range(rng.randint(*args.prompt_len))]}
               for _ in range(args.requests)]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    ray.init(num_cpus=max(8, max(args.pp)), include_dashboard=False, log_to_driver=False)
    rows = []
    for pp in args.pp:
        for mode in args.modes:
            if mode == "async_no_feedback" and pp == 1:
                continue  # no feedback at PP=1: the one rank samples
            async_scheduling = mode != "sync"
            trace = os.path.join(args.trace_dir, f"pp{pp}_{mode}.json") if args.trace_dir else None
            with LLM(model, pipeline_parallel_size=pp, device=args.device, dtype=args.dtype,
                     max_num_seqs=args.max_num_seqs or args.requests,
                     max_num_batched_tokens=args.max_num_batched_tokens,
                     async_scheduling=async_scheduling, pp_token_feedback=mode == "async",
                     trace_file=trace) as llm:
                llm.generate(prompts[:2], SamplingParams(max_tokens=2))  # warm-up
                before = llm.stats()
                t0 = time.perf_counter()
                outs = llm.generate(prompts, sp)
                elapsed = time.perf_counter() - t0
                st = llm.stats()
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            steps = st["num_steps"] - before["num_steps"]
            rows.append({"pp": pp, "mode": mode, "async": async_scheduling,
                         "max_inflight_steps": EngineConfig(
                             model=model, pipeline_parallel_size=pp, async_scheduling=async_scheduling,
                             pp_token_feedback=mode == "async").inflight_steps, "output_tok_s": round(n_out / elapsed, 1),
                         "elapsed_s": round(elapsed, 3), "steps": steps,
                         "stage_idle_fraction": idle_fractions_between(before, st),
                         "driver_plan_ms_per_step": round(1e3 * (st["driver_plan_s"] - before["driver_plan_s"]) / steps, 3),
                         "stage_digest_ms_per_step": [round(1e3 * (d - d0) / steps, 3) for d, d0 in
                                                      zip(st["stage_digest_s"], before["stage_digest_s"])]})
            r = rows[-1]
            print(f"PP={pp} {mode:17} {r['output_tok_s']:>8} tok/s "
                  f"steps {steps:>4}  idle {r['stage_idle_fraction']}  plan {r['driver_plan_ms_per_step']} ms/step "
                  f"digest {r['stage_digest_ms_per_step']} ms/step", flush=True)
    for pp in args.pp:
        by = {r["mode"]: r["output_tok_s"] for r in rows if r["pp"] == pp}
        for mode in ("async", "async_no_feedback"):
            if mode in by and "sync" in by:
                print(f"PP={pp}: {mode} / sync = {by[mode] / by['sync']:.2f}")
    ray.shutdown()
    path = save("pipeline_idle" + (f"_{args.tag}" if args.tag else ""), {"model": {"family": "llama", "hidden": args.hidden, "layers": args.layers,
                                            "dtype": args.dtype, "weights": "random"},
                                  "workload": {"requests": args.requests, "prompt_len": args.prompt_len,
                                               "max_tokens": args.max_tokens,
                                               "max_num_seqs": args.max_num_seqs or args.requests,
                                               "max_num_batched_tokens": args.max_num_batched_tokens},
                                  "rows": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
