"""roofline_fraction: how close a decode-only step at batch 256 comes to the GPU's memory
bandwidth. bytes moved per step (every weight once + every row's KV read) / step time, over
the HBM bandwidth measured in the same run (a device-to-device copy).

  python bench/roofline.py [--rows 256] [--prompt-len 128] [--short 32] [--long 96]

The step time of steady decode is the difference of two runs that differ only in output
length (same 256 prompts): (t_long - t_short) / (steps_long - steps_short), so prefill and
start-up cancel. The KV read per step is rows x mean context over that window x bytes per
token. The KV pool is sized by the profiling pass (gpu_memory_utilization 0.9).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import decode_step_bytes, mem_bandwidth, model_bytes, save  # noqa: E402
from bench.gpu_check import qwen3_dir  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--short", type=int, default=32)
    p.add_argument("--long", type=int, default=96)
    p.add_argument("--root", default="/tmp/ray_runtime_gpu")
    args = p.parse_args()
    import ray

    from ray_runtime import LLM, SamplingParams
    from stages.model_spec import ModelSpec

    bw = mem_bandwidth("cuda")
    model = qwen3_dir(args.root, 28, torch.bfloat16, small=False)
    spec = ModelSpec.from_dir(model)
    weight_bytes, kv_per_token = model_bytes(model, dtype_bytes=2)  # bf16
    rng = random.Random(0)
    prompts = [[rng.randrange(3, spec.vocab_size) for _ in range(args.prompt_len)]
               for _ in range(args.rows)]
    ray.init(include_dashboard=False)
    runs = {}
    with LLM(model, device="cuda", dtype="bfloat16", max_num_seqs=args.rows,
             max_num_batched_tokens=8192, max_model_len=args.prompt_len + args.long + 16) as llm:
        num_kv_blocks = llm.info["num_kv_blocks"]
        llm.generate([{"prompt_token_ids": q} for q in prompts],
                     SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
        for n in (args.short, args.long):
            before = llm.stats()["num_steps"]
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": q} for q in prompts],
                         SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            runs[n] = (time.perf_counter() - t0, llm.stats()["num_steps"] - before)
    ray.shutdown()
    dt = runs[args.long][0] - runs[args.short][0]
    dsteps = runs[args.long][1] - runs[args.short][1]
    step_s = dt / dsteps
    # Mean bytes over the steps the window adds (the long run's steps short .. long - 1).
    window = decode_step_bytes(weight_bytes, kv_per_token, [args.prompt_len] * args.rows,
                               [args.long] * args.rows)[args.short:args.long]
    kv_bytes = sum(window) / len(window) - weight_bytes
    achieved = (weight_bytes + kv_bytes) / step_s
    fraction = achieved / bw
    print(f"HBM copy bandwidth {bw / 1e9:.0f} GB/s; decode step at batch {args.rows}: "
          f"{step_s * 1e3:.1f} ms ({dsteps} steps); moved {(weight_bytes + kv_bytes) / 1e9:.2f} GB "
          f"per step = {achieved / 1e9:.0f} GB/s; roofline_fraction = {fraction:.3f}; "
          f"profiled KV pool: {num_kv_blocks} blocks", flush=True)
    print("wrote", save("roofline", {
        "model": {"shape": "Qwen3-0.6B", "layers": spec.num_layers, "dtype": "bfloat16",
                  "weights": "random", "weight_bytes": weight_bytes},
        "workload": {"rows": args.rows, "prompt_len": args.prompt_len,
                     "output_lens": [args.short, args.long], "greedy": True, "async": True},
        "hbm_copy_bandwidth_GBps": bw / 1e9, "decode_step_ms": step_s * 1e3,
        "decode_steps_in_window": dsteps, "kv_bytes_per_step": kv_bytes,
        "bytes_per_step": weight_bytes + kv_bytes, "achieved_GBps": achieved / 1e9,
        "roofline_fraction": fraction, "num_kv_blocks_profiled": num_kv_blocks,
        "gpu_memory_utilization": 0.9, "runs": {str(k): v for k, v in runs.items()}}))


if __name__ == "__main__":
    main()
