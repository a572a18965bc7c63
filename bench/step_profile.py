"""Where a decode step's time goes, at PP=1 without Ray: the real EngineCore over one
in-process StageRunner (LocalRanks), in lockstep (plan, encode, decode, execute, commit), each
phase timed on the host by wrapping the core's, the ranks' and the runner's methods; then a
torch.profiler table of the GPU kernels of a few steps; then the paged decode attention kernel
alone on one layer's cache, against the bytes it must read.

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
        # a phase that never ran (none at one row, say) has no entry rather than no median
        return {k: round(1e3 * statistics.median(v[skip:] or v), 3)
                for k, v in self.times.items() if v}


def build(args, model_dir: str, enforce_eager: bool):
    """The real EngineCore in lockstep (async_scheduling=False: one step in flight) over one
    in-process StageRunner (LocalRanks, serial)."""
    from ray_runtime.config import EngineConfig
    from ray_runtime.engine_core import EngineCore
    from ray_runtime.ranks import LocalRanks
    from stages.model_spec import ModelSpec
    from ray_runtime.layer_span import LayerSpan
    from stages.runner import StageRunner

    spec = ModelSpec.from_dir(model_dir)
    max_model_len = args.prompt_len + args.steps + 64
    per_req = -(-max_model_len // 16)
    cfg = EngineConfig(model=model_dir, device=args.device, dtype=args.dtype,
                       max_num_seqs=args.rows, max_num_batched_tokens=max(8192, args.rows),
                       num_kv_blocks=args.rows * per_req, max_model_len=max_model_len,
                       enforce_eager=enforce_eager, async_scheduling=False,
                       disable_log_stats=True)
    runner = StageRunner(cfg, 0, LayerSpan.of_layers(0, spec.num_layers), max_model_len)
    runner.init_kv_cache(cfg.num_kv_blocks)
    core = EngineCore(cfg, LocalRanks(runner, overlap=False), num_kv_blocks=cfg.num_kv_blocks,
                      max_model_len=max_model_len, eos_token_ids=spec.eos_token_ids)
    return spec, core


RANK_PHASES = ("rank_apply_plan", "rank_prepare_inputs", "rank_digests", "rank_forward",
               "rank_sample", "rank_finish")


def lockstep(args, model_dir: str, enforce_eager: bool) -> dict:
    """Prefill every prompt, then time steady decode phase by phase: EngineCore.step() with
    the core's, the scheduler's, the ranks' and the runner's methods wrapped by PhaseTimer.

    driver_plan_encode   schedule + encode (the core's plan time, less the ranks' send_plan)
    rank_execute_total   LocalRanks.send_plan (decode the plan, launch) + read_replies (finish)
    driver_decode_commit the rest of the step: audit, commit (update_from_output), collect
                         the finished, deltas; of which driver_audit and driver_commit
    step_total           EngineCore.step()
    """
    from ray_runtime.messages import RequestSpec
    from ray_runtime.sampling_params import RequestOutputKind, SamplingParams

    spec, core = build(args, model_dir, enforce_eager)
    runner, ranks, sched = core.ranks.runner, core.ranks, core.scheduler
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=args.steps + 40, temperature=0, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(args.rows):
        core.add_request(RequestSpec(str(i), [rng.randrange(3, spec.vocab_size)
                                              for _ in range(args.prompt_len)], sp))
    sync = args.device == "cuda"
    timer = PhaseTimer(sync)
    planned = []  # the plan of each step, as scheduled (lockstep: the one it completes)
    schedule = sched.schedule

    def schedule_seen():
        record = schedule()
        if record is not None:
            planned.append(record.plan)
        return record

    sched.schedule = schedule_seen
    timer.wrap(runner.batch, "apply_plan", "rank_apply_plan")
    timer.wrap(runner, "prepare_inputs", "rank_prepare_inputs")
    timer.wrap(runner.batch, "digests_of", "rank_digests")
    timer.wrap(runner, "_forward", "rank_forward")
    timer.wrap(runner.last, "sample_step", "rank_sample")  # logits and sampling
    timer.wrap(runner, "finish", "rank_finish")
    timer.wrap(ranks, "send_plan", "rank_send_plan")
    timer.wrap(ranks, "read_replies", "rank_read_replies")
    timer.wrap(sched, "update_from_output", "driver_commit")
    decode_steps = 0
    while decode_steps < args.steps:
        plan_s, audit_s = core.plan_s, core.audit_s
        t0 = time.perf_counter()
        core.step()
        t1 = time.perf_counter()
        plan = planned[-1]
        planned.clear()
        if plan.total_num_scheduled_tokens != args.rows:  # prefill steps: not what this measures
            for v in timer.times.values():
                v.clear()
            continue
        decode_steps += 1
        send, read = timer.times["rank_send_plan"][-1], timer.times["rank_read_replies"][-1]
        plan_encode = core.plan_s - plan_s - send
        timer.add("driver_plan_encode", plan_encode)
        timer.add("rank_execute_total", send + read)
        timer.add("driver_decode_commit", (t1 - t0) - plan_encode - send - read)
        timer.add("driver_audit", core.audit_s - audit_s)
        timer.add("step_total", t1 - t0)
    assert core.num_mismatches == 0
    med = timer.medians_ms(skip=4)
    med["rank_other"] = round(med["rank_execute_total"] - sum(
        med.get(k, 0.0) for k in RANK_PHASES), 3)
    prof = kernel_table(core) if args.device == "cuda" else None
    return {"enforce_eager": enforce_eager, "median_ms": med, "kernels": prof}


def kernel_table(core) -> list[dict]:
    """GPU kernel time over 8 more decode steps, top 20 by total CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            core.step()
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
                     "greedy": True, "mode": "PP=1 lockstep in one process, no Ray: EngineCore over LocalRanks"},
        "runs": runs, "attention_alone": attn})
    print("wrote", path)


if __name__ == "__main__":
    main()
