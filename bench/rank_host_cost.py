"""A stage's own host cost per step, without a model: what a rank does with each plan besides
launching its layers. The real EngineCore plans steady decode at PP=2 over EchoRanks
(ray_runtime/echo_ranks.py, as bench/driver_cost.py does), and every plan's bytes also go to
one real rank's bookkeeping (stages/input_batch.py InputBatch, stages/plan_view.py), a rank
that is neither first nor last (no sampler, no token feedback), timed phase by phase:

  decode    the plan's msgpack bytes -> StepPlan
  apply     InputBatch.apply_plan (removals, admissions, each request's new tokens and blocks)
  view      plan_view: per scheduled request, in layout order, what it runs
  digests   InputBatch.digests_of: the rows' fingerprints for the driver's audit (and the
            computed counts moved past the step, as the runner does after its launch)
  reply     the StageStepResult carrying them, msgpack-encoded

Its digests are checked equal to the echo ranks' (which the driver audits), so the bench
times bookkeeping the driver accepts. Per micro-batch size (the requests one step runs:
256 requests are micro-batches of 128 at PP=2 and 64 at PP=4), per phase the median over the
steady steps, the smallest over --repeats runs (the 2-core machine is shared).

  python bench/rank_host_cost.py [--rows 64 128 256] [--steps 200] [--repeats 3] [--tag cpu]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from bench.common import save  # noqa: E402
from bench.driver_cost import make_engine  # noqa: E402
from ray_runtime.echo_ranks import EchoRanks  # noqa: E402
from ray_runtime.messages import (StageStepResult, StageTiming, decode_plan,  # noqa: E402
                                  decode_result, encode)
from stages.input_batch import InputBatch  # noqa: E402
from stages.plan_view import plan_view  # noqa: E402

PHASES = ("decode", "apply", "view", "digests", "reply")


class MeasuredRank:
    """One real rank's bookkeeping beside the echo ranks: it gets every plan's bytes."""

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        self.batch = InputBatch(max_num_seqs, max_model_len, block_size)
        self.times: dict[str, list[float]] = {k: [] for k in PHASES}
        self.scheduled: list[int] = []
        self.digests = None

    def step(self, data: bytes) -> None:
        t = [time.perf_counter()]
        plan = decode_plan(data)
        t.append(time.perf_counter())
        self.batch.apply_plan(plan)
        t.append(time.perf_counter())
        view = plan_view(plan, self.batch)
        t.append(time.perf_counter())
        digests = self.batch.digests_of(view)
        self.batch.mark_computed_rows(view.slots, view.num_new)  # as the runner does after launch
        t.append(time.perf_counter())
        now = time.time()
        encode(StageStepResult(plan.step_id, 0, StageTiming(now, now, now, now, 0.0), digests))
        t.append(time.perf_counter())
        for name, a, b in zip(PHASES, t, t[1:]):
            self.times[name].append(b - a)
        self.scheduled.append(len(plan.scheduled_req_ids))
        self.digests = digests


class EchoWithRank(EchoRanks):
    def __init__(self, num_ranks: int, rank: MeasuredRank) -> None:
        super().__init__(num_ranks)
        self.rank = rank
        self.checked = 0

    def send_plan(self, plan: bytes) -> None:
        super().send_plan(plan)
        self.rank.step(plan)
        echo = decode_result(self._replies[-1][1][0]).digests
        if encode(self.rank.digests) != encode(echo):
            raise AssertionError(f"step {self.last_sent_plan.step_id}: the rank's digests "
                                 "differ from the echo ranks' (which the driver audits)")
        self.checked += 1


def run_once(rows: int, steps: int, prompt_len: int) -> dict:
    """PP=2 steady decode of 2 x rows requests (two micro-batches of `rows`)."""
    core = make_engine(2 * rows, 0, prompt_len, 2 * steps + 64, "pp2")
    cfg = core.config
    rank = MeasuredRank(cfg.max_num_seqs, cfg.max_model_len, cfg.block_size)
    core.ranks = EchoWithRank(2, rank)
    while sum(1 for n in rank.scheduled if n == rows) < steps + 8:
        core.step()
    assert core.num_mismatches == 0
    steady = [i for i, n in enumerate(rank.scheduled) if n == rows][8:]  # past the ramp
    med = {k: 1e6 * float(np.median([rank.times[k][i] for i in steady])) for k in PHASES}
    med["total"] = sum(med[k] for k in PHASES)
    return {"us": med, "checked": core.ranks.checked}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tag", default="cpu")
    args = p.parse_args()
    out = []
    for rows in args.rows:
        runs = [run_once(rows, args.steps, args.prompt_len) for _ in range(args.repeats)]
        us = {k: round(min(r["us"][k] for r in runs), 1) for k in runs[0]["us"]}
        out.append({"rows": rows, "us": us, "us_per_row": round(us["total"] / rows, 3),
                    "digests_checked": sum(r["checked"] for r in runs)})
        print(f"rows {rows:4d}: " + "  ".join(f"{k} {v:7.1f}" for k, v in us.items())
              + f" us   ({us['total'] / rows:.2f} us/row)", flush=True)
    path = save(f"rank_host_cost_{args.tag}", {
        "workload": {"steps": args.steps, "prompt_len": args.prompt_len,
                     "repeats": args.repeats, "mode": "PP=2 plans, a middle rank's bookkeeping",
                     "note": "per phase the median over steady decode steps, the smallest "
                             "over the repeats; us per step"},
        "rows": out})
    print("wrote", path)


if __name__ == "__main__":
    main()
