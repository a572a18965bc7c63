"""The overlapped step in one process, no Ray: the real EngineCore over one StageRunner at PP=1
(LocalRanks, ray_runtime/ranks.py), driven serially (async_scheduling=False: one step at a
time, finish N, then plan and launch N+1) and overlapped (the async default: two in flight,
placeholders on, LocalRanks(overlap=True) launches N+1, then finishes N), at several batch
sizes: ms per decode step, and optionally a torch.profiler table of the overlapped run (where
the device's time goes).

  python bench/overlap_profile.py [--rows 1 8 64 256] [--steps 64] [--profile-rows 64]
  python bench/overlap_profile.py --device cpu --small --rows 1 4 --steps 16 --prompt-len 32
      (a smoke run)
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import save  # noqa: E402


def build(model_dir: str, rows: int, max_model_len: int, device: str, dtype: str,
          overlapped: bool):
    """A fresh StageRunner (its batch and KV cache empty) under a fresh EngineCore."""
    from ray_runtime.config import EngineConfig
    from ray_runtime.engine_core import EngineCore
    from ray_runtime.ranks import LocalRanks
    from stages.model_spec import ModelSpec
    from ray_runtime.layer_span import LayerSpan
    from stages.runner import StageRunner

    spec = ModelSpec.from_dir(model_dir)
    blocks = rows * -(-max_model_len // 16)
    cfg = EngineConfig(model=model_dir, device=device, dtype=dtype, max_num_seqs=max(rows, 8),
                       max_num_batched_tokens=max(8192, rows), num_kv_blocks=blocks,
                       max_model_len=max_model_len, async_scheduling=overlapped,
                       disable_log_stats=True)
    runner = StageRunner(cfg, 0, LayerSpan.of_layers(0, spec.num_layers), max_model_len)
    runner.init_kv_cache(blocks)
    core = EngineCore(cfg, LocalRanks(runner, overlap=overlapped), num_kv_blocks=blocks,
                      max_model_len=max_model_len, eos_token_ids=spec.eos_token_ids)
    return spec, core


def run(core, spec, rows: int, prompt_len: int, steps: int, profiler=None) -> float:
    """ms per step over the decode steps after a warm-up: the time from one EngineCore.step()
    to the next when the step it completed ran every request one token."""
    from ray_runtime.messages import RequestSpec
    from ray_runtime.sampling_params import RequestOutputKind, SamplingParams

    rng = random.Random(0)
    sp = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(rows):
        core.add_request(RequestSpec(str(i), [rng.randrange(3, spec.vocab_size)
                                              for _ in range(prompt_len)], sp))
    full: set[int] = set()  # step ids of full decode steps: every request, one token
    completed: list[int] = []  # step ids, in the order their replies were read
    runner, ranks = core.ranks.runner, core.ranks
    launch, read_replies = runner.launch, ranks.read_replies

    def launch_seen(plan):
        if len(plan.scheduled_req_ids) == rows and plan.total_num_scheduled_tokens == rows:
            full.add(plan.step_id)
        return launch(plan)

    def read_seen(step_id: int):
        completed.append(step_id)
        return read_replies(step_id)

    runner.launch, ranks.read_replies = launch_seen, read_seen
    times = []
    t_prev = None
    while core.has_work():
        n = len(completed)
        core.step()
        now = time.perf_counter()
        if t_prev is not None and len(completed) > n and completed[-1] in full:
            times.append(now - t_prev)
        t_prev = now
        if profiler is not None:
            profiler.step()
    assert core.num_mismatches == 0
    times = times[8:]
    return 1e3 * sum(times) / max(1, len(times))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--profile-rows", type=int, default=None)
    p.add_argument("--root", default="/tmp/ray_runtime_gpu")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--small", action="store_true", help="a tiny Qwen3 shape (CPU smoke)")
    args = p.parse_args()
    import torch

    from bench.gpu_check import qwen3_dir

    cuda = args.device == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    model_dir = qwen3_dir(args.root, 2 if args.small else 28, getattr(torch, dtype),
                          small=args.small)
    max_model_len = args.prompt_len + args.steps + 32

    def measure(rows: int, overlapped: bool, profiler=None) -> float:
        spec, core = build(model_dir, rows, max_model_len, args.device, dtype, overlapped)
        try:
            return run(core, spec, rows, args.prompt_len, args.steps, profiler=profiler)
        finally:
            del core
            if cuda:
                torch.cuda.empty_cache()

    results = []
    for rows in args.rows:
        row = {"rows": rows}
        for mode in ("serial", "overlapped"):
            row[f"{mode}_ms_per_step"] = round(measure(rows, mode == "overlapped"), 3)
        print(row, flush=True)
        results.append(row)
        if rows == args.profile_rows:
            from torch.profiler import ProfilerActivity, profile, schedule

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities,
                         schedule=schedule(wait=20, warmup=2, active=8)) as prof:
                measure(rows, True, profiler=prof)
            print(prof.key_averages().table(
                sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=25))
            out = os.environ.get("BENCH_OUT")
            if out:
                prof.export_chrome_trace(os.path.join(out, f"overlap_rows{rows}.json"))
    save("overlap_profile_" + os.environ.get("BENCH_TAG", "gpu"), {"rows": results})


if __name__ == "__main__":
    main()
