"""Decode latency: ms per decode step and output tok/s at 1, 8, 64 and 256 running requests,
async and sync scheduling in the same run, PP=1 on one GPU; random bf16 weights of a
Qwen3-0.6B shape, 256-token prompts, 256 output tokens, greedy, ignore_eos.

  python bench/latency.py [--concurrency 1 8 64 256] [--prompt-len 256] [--output-len 256]
                          [--modes async sync] [--model DIR] [--tag h100]
  python bench/latency.py --device cpu --dtype float32 --concurrency 1 4 --prompt-len 16 --output-len 8

One LLM per mode, reused across concurrencies. Per concurrency c: a prefill-only call of the
c prompts (max_tokens=1), then the same c prompts with output_len tokens;
ms per decode step = (wall - prefill wall) / (output_len - 1), tok/s = c * output_len / wall.
floor_ms: the step's bytes (weights once + c requests' KV) at the copy bandwidth measured in
the same run. gpu_busy_fraction: stage 0's GPU-busy seconds in the decode part (full run's
minus the prefill call's) over the decode wall, when stats() has stage_gpu_busy_s.
Without --model: the Qwen3-0.6B shape (CUDA) or a tiny random Llama (CPU, a smoke test).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import (decode_step_bytes, device_name, idle_fractions_between,  # noqa: E402
                          mem_bandwidth, model_bytes, save, tiny_llama)
from bench.gpu_check import qwen3_dir  # noqa: E402


def device_tag(device: str) -> str:
    """The results file's tag: "h100" for an "NVIDIA H100 80GB HBM3", "cpu" on CPU."""
    if device != "cuda":
        return "cpu"
    words = torch.cuda.get_device_name(0).replace("NVIDIA", "").split()
    return re.sub(r"[^a-z0-9]+", "", words[0].lower()) if words else "gpu"


def delta(before: dict, after: dict, key: str):
    """Per-rank increase of a cumulative per-stage list in stats(); None where it is absent."""
    if key not in before or key not in after:
        return None
    return [round(a - b, 6) for a, b in zip(after[key], before[key])]


def timed(llm, reqs, sp):
    before = llm.stats()
    t0 = time.perf_counter()
    llm.generate(reqs, sp)
    wall = time.perf_counter() - t0
    return wall, before, llm.stats()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--modes", nargs="+", choices=["async", "sync"], default=["async", "sync"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model", default=None, help="HF dir; default: Qwen3-0.6B shape (cuda), tiny Llama (cpu)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--root", default="/tmp/ray_runtime_gpu")
    p.add_argument("--tag", default=None, help="results file latency_<tag>.json; default: device (h100, cpu)")
    args = p.parse_args()
    if args.output_len < 2:
        p.error("--output-len must be at least 2 (one prefill token, then decode steps)")
    import ray

    from ray_runtime import LLM, SamplingParams

    dtype = getattr(torch, args.dtype)
    if args.model:
        model = args.model
    elif args.device == "cuda":
        model = qwen3_dir(args.root, 28, torch.bfloat16, small=False)  # the dir throughput.py uses
    else:  # CPU smoke: a model small enough that a few steps take seconds, not minutes
        model = tiny_llama(os.path.join(args.root, "llama_latency_tiny"), hidden=64, layers=2,
                           heads=2, kv_heads=1, intermediate=192, vocab=512)
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    # Measured before the engine starts: on CUDA the engine then takes most of the memory.
    bw = mem_bandwidth(args.device, gib=2.0 if args.device == "cuda" else 0.25)
    weight_bytes, kv_per_token = model_bytes(model, dtype_bytes=torch.finfo(dtype).bits // 8)

    rng = random.Random(0)
    top = max(args.concurrency)
    prompts = [[rng.randrange(3, cfg["vocab_size"]) for _ in range(args.prompt_len)] for _ in range(top)]
    greedy = dict(temperature=0.0, ignore_eos=True)
    ray.init(include_dashboard=False)
    rows = []
    for mode in args.modes:
        with LLM(model, device=args.device, dtype=args.dtype, max_num_seqs=top,
                 max_num_batched_tokens=args.max_num_batched_tokens,
                 max_model_len=args.prompt_len + args.output_len,  # keeps the KV pool to what runs
                 async_scheduling=mode == "async") as llm:
            llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4, **greedy))
            for c in args.concurrency:
                reqs = [{"prompt_token_ids": q} for q in prompts[:c]]
                # Warm-up with the same shapes: Triton compiles a kernel per new prefill
                # shape, which would otherwise land inside the timed window.
                timed(llm, reqs, SamplingParams(max_tokens=4, **greedy))
                pre_s, pb, pa = timed(llm, reqs, SamplingParams(max_tokens=1, **greedy))
                wall, b, a = timed(llm, reqs, SamplingParams(max_tokens=args.output_len, **greedy))
                decode_s = wall - pre_s
                step_ms = 1e3 * decode_s / (args.output_len - 1)
                # The decode steps (1 .. output_len - 1) of c requests in lockstep.
                steps = decode_step_bytes(weight_bytes, kv_per_token, [args.prompt_len] * c,
                                          [args.output_len] * c)[1:]
                floor_ms = 1e3 * sum(steps) / len(steps) / bw
                gpu, pre_gpu = delta(b, a, "stage_gpu_busy_s"), delta(pb, pa, "stage_gpu_busy_s")
                rows.append({
                    "mode": mode, "concurrency": c, "wall_s": round(wall, 4),
                    "prefill_s": round(pre_s, 4), "decode_s": round(decode_s, 4),
                    "ms_per_step": round(step_ms, 3), "output_tok_s": round(c * args.output_len / wall, 1),
                    "floor_ms": round(floor_ms, 3), "floor_fraction": round(floor_ms / step_ms, 3),
                    "num_steps": a["num_steps"] - b["num_steps"],
                    "prefill_num_steps": pa["num_steps"] - pb["num_steps"],
                    "stage_gpu_busy_s": gpu, "prefill_stage_gpu_busy_s": pre_gpu,
                    "gpu_busy_fraction": None if gpu is None else round((gpu[0] - pre_gpu[0]) / decode_s, 3),
                    "stage_busy_s": delta(b, a, "stage_busy_s"), "stage_idle_s": delta(b, a, "stage_idle_s"),
                    "stage_idle_fraction": (idle_fractions_between(b, a)
                                            if "stage_busy_s" in a and "stage_idle_s" in a else None)})
                r = rows[-1]
                print(f"{mode:>5} c={c:<4} {r['ms_per_step']:8.3f} ms/step  floor {r['floor_ms']:7.3f} ms  "
                      f"{r['output_tok_s']:9.1f} tok/s  steps {r['num_steps']}  gpu_busy {r['gpu_busy_fraction']}",
                      flush=True)
    ray.shutdown()

    print(f"\n{device_name()}; copy bandwidth {bw / 1e9:.0f} GB/s; weights {weight_bytes / 1e6:.1f} MB, "
          f"KV {kv_per_token} B/token")
    print(f"{'mode':>5} {'conc':>5} {'ms/step':>9} {'floor_ms':>9} {'floor/step':>10} {'tok/s':>10} {'gpu_busy':>8}")
    for r in rows:
        busy = "-" if r["gpu_busy_fraction"] is None else f"{r['gpu_busy_fraction']:.3f}"
        print(f"{r['mode']:>5} {r['concurrency']:>5} {r['ms_per_step']:>9.3f} {r['floor_ms']:>9.3f} "
              f"{r['floor_fraction']:>10.3f} {r['output_tok_s']:>10.1f} {busy:>8}")
    print("wrote", save(f"latency_{args.tag or device_tag(args.device)}", {
        "model": {"dir": os.path.basename(model.rstrip("/")), "architecture": cfg["architectures"][0],
                  "layers": cfg["num_hidden_layers"], "hidden": cfg["hidden_size"],
                  "heads": cfg["num_attention_heads"], "kv_heads": cfg.get("num_key_value_heads"),
                  "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                  "vocab": cfg["vocab_size"], "dtype": args.dtype, "weights": args.model or "random",
                  "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token},
        "workload": {"concurrency": args.concurrency, "prompt_len": args.prompt_len,
                     "output_len": args.output_len, "modes": args.modes, "greedy": True,
                     "ignore_eos": True, "pp": 1, "device": args.device,
                     "max_num_batched_tokens": args.max_num_batched_tokens, "seed": 0},
        "copy_bandwidth_GBps": round(bw / 1e9, 1),
        "rows": rows}))


if __name__ == "__main__":
    main()
