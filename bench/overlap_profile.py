"""The overlapped step in one process, no Ray: the real Scheduler and StageRunner at PP=1 with
placeholders, driven serially (one step at a time: finish N, then plan and launch N+1) and
overlapped (two in flight: launch N+1, then finish N), at several batch sizes: ms per decode step, and optionally a
torch.profiler table of the overlapped run (where the device's time goes).

  python bench/overlap_profile.py [--rows 1 8 64 256] [--steps 64] [--profile-rows 64]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections import deque

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import save  # noqa: E402


def build(model_dir: str, rows: int, max_model_len: int, device: str, dtype: str):
    from ray_runtime.config import EngineConfig
    from ray_runtime.scheduler import Scheduler
    from stages.model_spec import ModelSpec
    from stages.runner import StageRunner

    spec = ModelSpec.from_dir(model_dir)
    blocks = rows * -(-max_model_len // 16)
    cfg = EngineConfig(model=model_dir, device=device, dtype=dtype, max_num_seqs=max(rows, 8),
                       max_num_batched_tokens=max(8192, rows), num_kv_blocks=blocks,
                       max_model_len=max_model_len)
    runner = StageRunner(cfg, 0, (0, spec.num_layers), max_model_len)
    runner.init_kv_cache(blocks)
    sched = Scheduler(max_num_seqs=max(rows, 8), max_num_batched_tokens=cfg.max_num_batched_tokens,
                      num_kv_blocks=blocks, block_size=16, max_model_len=max_model_len,
                      allow_placeholders=True)
    return spec, runner, sched


def run(runner, sched, spec, rows: int, prompt_len: int, steps: int, overlapped: bool,
        profiler=None) -> float:
    """ms per step over the decode steps after a warm-up."""
    from ray_runtime.request import Request
    from ray_runtime.sampling_params import SamplingParams

    rng = random.Random(0)
    for i in range(rows):
        sched.add_request(Request(f"{overlapped}-{i}", [rng.randrange(3, spec.vocab_size) for _ in range(prompt_len)],
                                  SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True),
                                  frozenset(), i))
    launched: deque = deque()
    times = []
    t_prev = None
    while sched.has_unfinished() or launched:
        # serial: one step at a time, finished before the next is planned (the sync loop)
        while len(launched) < (2 if overlapped else 1):
            record = sched.schedule()
            if record is None:
                break
            launched.append((record, runner.launch(record.plan)))
        rec, step = launched.popleft()
        sched.update_from_output(rec, runner.finish(step).sampler_output, frozenset())
        sched.pop_finished()
        now = time.perf_counter()
        if t_prev is not None and len(rec.plan.scheduled_req_ids) == rows \
                and rec.plan.total_num_scheduled_tokens == rows:
            times.append(now - t_prev)
        t_prev = now
        if profiler is not None:
            profiler.step()
    times = times[8:]
    return 1e3 * sum(times) / max(1, len(times))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--profile-rows", type=int, default=None)
    p.add_argument("--root", default="/tmp/ray_runtime_gpu")
    args = p.parse_args()
    import torch

    from bench.gpu_check import qwen3_dir

    model_dir = qwen3_dir(args.root, 28, torch.bfloat16, small=False)
    results = []
    for rows in args.rows:
        spec, runner, sched = build(model_dir, rows, args.prompt_len + args.steps + 32, "cuda", "bfloat16")
        row = {"rows": rows}
        for mode in ("serial", "overlapped"):
            row[f"{mode}_ms_per_step"] = round(run(runner, sched, spec, rows, args.prompt_len,
                                                   args.steps, mode == "overlapped"), 3)
        print(row, flush=True)
        results.append(row)
        if rows == args.profile_rows:
            from torch.profiler import ProfilerActivity, profile, schedule

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                         schedule=schedule(wait=20, warmup=2, active=8)) as prof:
                run(runner, sched, spec, rows, args.prompt_len, args.steps, True, profiler=prof)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
            out = os.environ.get("BENCH_OUT")
            if out:
                prof.export_chrome_trace(os.path.join(out, f"overlap_rows{rows}.json"))
        del runner, sched
        torch.cuda.empty_cache()
    save("overlap_profile_" + os.environ.get("BENCH_TAG", "gpu"), {"rows": results})


if __name__ == "__main__":
    main()
