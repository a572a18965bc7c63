"""Where a decode step's time goes, at PP=1 without Ray: the real Scheduler and StageRunner in
one process, in lockstep (plan, encode, decode, execute, commit), each phase timed on the
host; then a torch.profiler table of the GPU kernels of a few steps; then the paged decode
attention kernel alone on one layer's cache, against the bytes it must read.

  python bench/step_profile.py [--rows 256] [--prompt-len 128] [--steps 64] [--eager]
  python bench/step_profile.py --device cpu --small   (a smoke run)
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import save  # noqa: E402
from bench.gpu_check import qwen3_dir  # noqa: E402


class PhaseTimer:
    """Wraps bound methods so each call's host time lands in a named bucket; with sync=True
    the GPU is drained after the call, so its kernels are charged to it."""

    def __init__(self, sync: bool) -> None:
        self.sync = sync
        self.times: dict[str, list[float]] = defaultdict(list)

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            if self.sync:
                torch.cuda.synchronize()
            self.times[name].append(time.perf_counter() - t0)
            return out

        setattr(obj, attr, timed)

    def add(self, name: str, dt: float) -> None:
        self.times[name].append(dt)

    def medians_ms(self, skip: int) -> dict[str, float]:
        return {k: round(1e3 * statistics.median(v[skip:] or v), 3) for k, v in self.times.items()}


def build(args, model_dir: str, enforce_eager: bool):
    from ray_runtime.config import EngineConfig
    from ray_runtime.scheduler import Scheduler
    from stages.runner import StageRunner
    from stages.model_spec import ModelSpec

    spec = ModelSpec.from_dir(model_dir)
    max_model_len = args.prompt_len + args.steps + 64
    per_req = -(-max_model_len // 16)
    cfg = EngineConfig(model=model_dir, device=args.device, dtype=args.dtype,
                       max_num_seqs=args.rows, max_num_batched_tokens=max(8192, args.rows),
                       num_kv_blocks=args.rows * per_req, max_model_len=max_model_len,
                       enforce_eager=enforce_eager)
    runner = StageRunner(cfg, 0, (0, spec.num_layers), max_model_len)
    runner.init_kv_cache(cfg.num_kv_blocks)
    sched = Scheduler(max_num_seqs=args.rows, max_num_batched_tokens=cfg.max_num_batched_tokens,
                      num_kv_blocks=cfg.num_kv_blocks, block_size=16, max_model_len=max_model_len)
    return spec, runner, sched


def lockstep(args, model_dir: str, enforce_eager: bool) -> dict:
    """Prefill every prompt, then time steady decode phase by phase."""
    from ray_runtime.messages import decode_plan, decode_result, encode
    from ray_runtime.request import Request
    from ray_runtime.sampling_params import SamplingParams

    spec, runner, sched = build(args, model_dir, enforce_eager)
    rng = random.Random(0)
    for i in range(args.rows):
        sched.add_request(Request(str(i), [rng.randrange(3, spec.vocab_size) for _ in range(args.prompt_len)],
                                  SamplingParams(max_tokens=args.steps + 40, temperature=0, ignore_eos=True),
                                  frozenset(), i))
    sync = args.device == "cuda"
    timer = PhaseTimer(sync)
    timer.wrap(runner.batch, "apply_plan", "rank_apply_plan")
    timer.wrap(runner, "prepare_inputs", "rank_prepare_inputs")
    timer.wrap(runner.batch, "digests", "rank_digests")
    timer.wrap(runner, "_forward", "rank_forward")
    timer.wrap(runner.last, "sample_step", "rank_sample")  # logits and sampling
    timer.wrap(runner, "finish", "rank_finish")
    decode_steps = 0
    while decode_steps < args.steps:
        t0 = time.perf_counter()
        record = sched.schedule()
        plan_bytes = encode(record.plan)
        t1 = time.perf_counter()
        result = runner.execute(decode_plan(plan_bytes))
        result_bytes = encode(result)
        t2 = time.perf_counter()
        out = decode_result(result_bytes).sampler_output
        sched.update_from_output(record, out, frozenset())
        t3 = time.perf_counter()
        is_decode = record.plan.total_num_scheduled_tokens == args.rows
        if not is_decode:  # prefill steps: not what this measures
            for v in timer.times.values():
                v.clear()
            continue
        decode_steps += 1
        timer.add("driver_plan_encode", t1 - t0)
        timer.add("rank_execute_total", t2 - t1)
        timer.add("driver_decode_commit", t3 - t2)
        timer.add("step_total", t3 - t0)
    med = timer.medians_ms(skip=4)
    med["rank_other"] = round(med["rank_execute_total"] - sum(
        med.get(k, 0.0) for k in ("rank_apply_plan", "rank_prepare_inputs", "rank_digests",
                                   "rank_forward", "rank_sample", "rank_finish")), 3)
    prof = kernel_table(runner, sched, args) if args.device == "cuda" else None
    return {"enforce_eager": enforce_eager, "median_ms": med, "kernels": prof}


def kernel_table(runner, sched, args) -> list[dict]:
    """GPU kernel time over 8 more decode steps, top 20 by total CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    from ray_runtime.messages import decode_plan, encode

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            record = sched.schedule()
            res = runner.execute(decode_plan(encode(record.plan)))
            sched.update_from_output(record, res.sampler_output, frozenset())
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        cuda_us = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if cuda_us and e.key and not e.key.startswith("ProfilerStep"):
            rows.append({"name": e.key[:90], "calls": e.count, "cuda_ms_per_step": round(cuda_us / 8e3, 3),
                         "cpu_ms_per_step": round(e.cpu_time_total / 8e3, 3)})
    rows.sort(key=lambda r: -r["cuda_ms_per_step"])
    return rows[:25]


def attention_alone(args, spec) -> list[dict]:
    """The decode attention kernel on one layer: rows x ctx tokens, GB/s of KV read."""
    from kernels.decode_attention_triton import paged_decode_attention

    out = []
    for rows, ctx in ((args.rows, args.prompt_len + args.steps // 2), (1, 4096), (8, 2048), (64, 1024)):
        bs = 16
        per = -(-ctx // bs)
        dt = getattr(torch, args.dtype)
        k = torch.randn(rows * per, bs, spec.num_kv_heads, spec.head_dim, device="cuda", dtype=dt)
        v = torch.randn_like(k)
        tables = torch.randperm(rows * per, device="cuda").view(rows, per)
        q = torch.randn(rows, spec.num_heads, spec.head_dim, device="cuda", dtype=dt)
        lens = torch.full((rows,), ctx, device="cuda", dtype=torch.long)
        for _ in range(3):
            paged_decode_attention(q, k, v, tables, lens, 0.1)
        torch.cuda.synchronize()
        reps = 50
        t0 = time.perf_counter()
        for _ in range(reps):
            paged_decode_attention(q, k, v, tables, lens, 0.1)
        torch.cuda.synchronize()
        us = (time.perf_counter() - t0) / reps * 1e6
        kv_bytes = 2 * rows * ctx * spec.num_kv_heads * spec.head_dim * k.element_size()
        out.append({"rows": rows, "ctx": ctx, "us": round(us, 1), "GBps": round(kv_bytes / us / 1e3, 1)})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="a tiny Qwen3 shape (CPU smoke)")
    p.add_argument("--root", default="/tmp/ray_runtime_gpu")
    p.add_argument("--tag", default="h200")
    args = p.parse_args()
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    model_dir = qwen3_dir(args.root, 2 if args.small else 28, getattr(torch, args.dtype), small=args.small)
    runs = [lockstep(args, model_dir, enforce_eager=True)]
    if args.device == "cuda":
        runs.append(lockstep(args, model_dir, enforce_eager=False))
    from stages.model_spec import ModelSpec

    spec = ModelSpec.from_dir(model_dir)
    attn = attention_alone(args, spec) if args.device == "cuda" else None
    for r in runs:
        print(f"enforce_eager={r['enforce_eager']}:")
        for k, v in r["median_ms"].items():
            print(f"  {k:24s} {v:9.3f} ms")
        for row in r["kernels"] or []:
            print(f"  {row['cuda_ms_per_step']:8.3f} ms/step  {row['calls']:6d}  {row['name']}")
    for a in attn or []:
        print(f"attention rows={a['rows']} ctx={a['ctx']}: {a['us']} us, {a['GBps']} GB/s")
    path = save(f"step_profile_{args.tag}", {
        "model": {"shape": "qwen3-small" if args.small else "Qwen3-0.6B", "dtype": args.dtype,
                  "weights": "random"},
        "workload": {"rows": args.rows, "prompt_len": args.prompt_len, "decode_steps": args.steps,
                     "greedy": True, "mode": "PP=1 lockstep in one process, no Ray"},
        "runs": runs, "attention_alone": attn})
    print("wrote", path)


if __name__ == "__main__":
    main()
