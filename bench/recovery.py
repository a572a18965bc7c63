"""Recovery time after a stage is killed: how long the engine takes to replace its stages and
finish every request, next to the same call undisturbed.

  python bench/recovery.py --device cuda --dtype bfloat16 --pp 1 --tag h100   # Qwen3-0.6B shape
  python bench/recovery.py --device cpu --pp 3 --tag cpu                        # tiny Llama

Per repeat: an undisturbed call of N requests, then the same call with the process of stage
`--rank` killed (os._exit) a few steps in. Reported: the replacement time the driver measured
(stats()["stage_recovery_s"]: lost stage seen -> new stages placed, loaded, connected), the
extra wall time of the disturbed call over the undisturbed one, and whether every output of
the disturbed call equals the undisturbed one (greedy).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import gpu_ray_env, save, tiny_llama  # noqa: E402


class ExitAtStep:
    """The stage's process dies at the first plan with step_id >= step (a crash, a lost node)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def __call__(self, batch, plan) -> None:
        if plan.step_id >= self.step:
            os._exit(1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--rank", type=int, default=None, help="the rank to kill (default: the last)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--kill-after-steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=None)
    p.add_argument("--root", default="/tmp/ray_pp_bench_models")
    p.add_argument("--tag", default="cpu")
    args = p.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.model:
        model = args.model
    elif args.device == "cuda":
        import torch

        from bench.gpu_check import qwen3_dir

        model = qwen3_dir(args.root, 28, torch.bfloat16, small=False)
    else:
        model = tiny_llama(os.path.join(args.root, "llama_recovery_tiny"), hidden=64, layers=6,
                           heads=4, kv_heads=2, intermediate=128, vocab=512)
    import ray

    from ray_runtime import LLM, SamplingParams

    ray.init(include_dashboard=False, num_cpus=max(os.cpu_count() or 1, 2 * args.pp + 2),
             runtime_env={"env_vars": gpu_ray_env()})
    rng = random.Random(0)
    with LLM(model, pipeline_parallel_size=args.pp, device=args.device, dtype=dtype,
             max_num_seqs=args.requests, max_num_batched_tokens=max(512, args.prompt_len),
             max_model_len=args.prompt_len + args.output_len + 16,
             max_stage_restarts=args.repeats) as llm:
        vocab = llm.info["vocab_size"]
        prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.prompt_len)]}
                   for _ in range(args.requests)]
        sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:2], sp, use_tqdm=False)  # warm-up (kernels, graphs)
        rank = args.pp - 1 if args.rank is None else args.rank
        rows = []
        for rep in range(args.repeats):
            t0 = time.perf_counter()
            ref = llm.generate(prompts, sp, use_tqdm=False)
            clean_s = time.perf_counter() - t0
            llm._set_fault_hook(rank, ExitAtStep(llm.stats()["num_steps"] + args.kill_after_steps))
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            disturbed_s = time.perf_counter() - t0
            stats = llm.stats()
            equal = [list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
                     for a, b in zip(outs, ref)]
            same = all(equal)
            rows.append({"repeat": rep, "undisturbed_s": round(clean_s, 3),
                         "disturbed_s": round(disturbed_s, 3),
                         "extra_s": round(disturbed_s - clean_s, 3),
                         "replacement_s": round(stats["stage_recovery_s"][-1], 3),
                         "outputs_equal_undisturbed": same,
                         "num_outputs_equal": sum(equal), "num_outputs": len(equal)})
            print(rows[-1], flush=True)
        assert llm.stats()["num_stage_restarts"] == args.repeats
    result = {"device_kind": args.device, "dtype": dtype, "pp": args.pp, "killed_rank": rank,
              "model": os.path.basename(model.rstrip("/")), "requests": args.requests,
              "prompt_len": args.prompt_len, "output_len": args.output_len, "rows": rows,
              "replacement_s_median": statistics.median(r["replacement_s"] for r in rows),
              "extra_s_median": statistics.median(r["extra_s"] for r in rows),
              "all_outputs_equal": all(r["outputs_equal_undisturbed"] for r in rows)}
    print(save(f"recovery_{args.tag}", result))


if __name__ == "__main__":
    main()
