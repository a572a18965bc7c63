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

With --baseline DIR (another checkout, e.g. `git worktree add /tmp/base COMMIT`), each of
--rounds rounds runs this bench once on the baseline's code and once on this checkout's, in
fresh processes, alternating, so that the machine's drift reaches both alike; per phase the
smallest over the rounds, and their ratio.

  python bench/rank_host_cost.py [--rows 64 128 256] [--steps 200] [--repeats 3] [--tag cpu]
  python bench/rank_host_cost.py --baseline /tmp/base --rounds 6 [--cpu 1] [--tag cpu_ab]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# --code-root: whose ray_runtime/stages to time (a baseline checkout); this file's by default
CODE_ROOT = sys.argv[sys.argv.index("--code-root") + 1] if "--code-root" in sys.argv \
    else os.path.dirname(HERE)
sys.path.insert(0, CODE_ROOT)
sys.path.insert(1, os.path.dirname(HERE))  # bench.common, bench.driver_cost: this checkout's

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


def measure(rows_list: list[int], steps: int, prompt_len: int, repeats: int) -> list[dict]:
    out = []
    for rows in rows_list:
        runs = [run_once(rows, steps, prompt_len) for _ in range(repeats)]
        us = {k: round(min(r["us"][k] for r in runs), 1) for k in runs[0]["us"]}
        out.append({"rows": rows, "us": us, "us_per_row": round(us["total"] / rows, 3),
                    "digests_checked": sum(r["checked"] for r in runs)})
    return out


def _show(label: str, out: list[dict]) -> None:
    for r in out:
        print(f"{label}rows {r['rows']:4d}: " + "  ".join(f"{k} {v:7.1f}" for k, v in r["us"].items())
              + f" us   ({r['us_per_row']:.2f} us/row)", flush=True)


def _child(code_root: str, args) -> list[dict]:
    """One measurement of `code_root`'s code in a fresh process (pinned to --cpu if given)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--code-root", code_root,
               "--rows", *map(str, args.rows), "--steps", str(args.steps),
               "--prompt-len", str(args.prompt_len), "--repeats", "1", "--json-out", path]
        if args.cpu is not None:
            cmd = ["taskset", "-c", str(args.cpu)] + cmd
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            return json.load(f)


def compare(args) -> dict:
    """--rounds x (baseline, this), alternating; per phase the smallest over the rounds."""
    ours = os.path.dirname(HERE)
    runs = {"baseline": [], "this": []}
    for i in range(args.rounds):
        for name, root in (("baseline", args.baseline), ("this", ours)):
            runs[name].append(_child(root, args))
            _show(f"round {i + 1} {name:>8} ", runs[name][-1])
    rows = []
    for j, n in enumerate(args.rows):
        best = {name: {k: min(r[j]["us"][k] for r in rs) for k in rs[0][j]["us"]}
                for name, rs in runs.items()}
        rows.append({"rows": n, "baseline_us": best["baseline"], "this_us": best["this"],
                     "ratio": {k: round(best["this"][k] / best["baseline"][k], 3)
                               for k in best["this"]}})
        print(f"rows {n:4d}: this / baseline " + "  ".join(
            f"{k} {v:.2f}" for k, v in rows[-1]["ratio"].items()), flush=True)
    try:
        base_commit = subprocess.check_output(["git", "-C", args.baseline, "rev-parse", "--short",
                                               "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        base_commit = "unknown"
    return {"baseline": args.baseline, "baseline_commit": base_commit, "rounds": args.rounds,
            "cpu": args.cpu,
            "rows": rows, "runs": runs}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tag", default="cpu")
    p.add_argument("--baseline", default=None, help="a checkout to time beside this one")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--cpu", type=int, default=None, help="pin each run to this CPU (taskset)")
    p.add_argument("--code-root", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    workload = {"steps": args.steps, "prompt_len": args.prompt_len,
                "mode": "PP=2 plans, a middle rank's bookkeeping",
                "note": "us per step; per phase the median over steady decode steps, the "
                        "smallest over the repeats (or, with a baseline, over the rounds)"}
    if args.json_out:  # a child of compare()
        with open(args.json_out, "w") as f:
            json.dump(measure(args.rows, args.steps, args.prompt_len, args.repeats), f)
        return
    if args.baseline:
        path = save(f"rank_host_cost_{args.tag}", {"workload": workload, **compare(args)})
    else:
        out = measure(args.rows, args.steps, args.prompt_len, args.repeats)
        _show("", out)
        path = save(f"rank_host_cost_{args.tag}",
                    {"workload": {**workload, "repeats": args.repeats}, "rows": out})
    print("wrote", path)


if __name__ == "__main__":
    main()
