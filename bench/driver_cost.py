"""The driver's own cost per step, without Ray or a model: EngineCore.step() itself (plan:
schedule + msgpack encode; reading the ranks' replies: msgpack decode; the audit of every
rank's digests; commit: update_from_output; pop_finished; the deltas) over EchoRanks
(ray_runtime/echo_ranks.py: ranks that keep their bookkeeping from the plans alone and answer
with digests and one token per sampling request). The echo's own time (being the ranks:
applying the plan, digests, sampling, encoding its replies) is measured and taken out. At 16,
64 and 256 running requests in steady decode, in three modes:

  sync      async_scheduling=False: every running request in every step, one in flight
  pp1_async the default at PP=1: placeholders on, two plans in flight (a step is planned on
            the pending sample of the step before it)
  pp2       the default at PP=2: no placeholders, two plans in flight (requests wait for
            their token, so the running requests split into two micro-batches); two ranks
            reply, and both are audited

Per mode, a least-squares line over the three sizes, per step = fixed + per_request x
(requests scheduled in the step): the issue's target is <= ~2 us per scheduled request + 100
us fixed (at pp2 the step holds two ranks' audits; audit_ms_per_rank is one). Then the queue:
a few running requests with 500 and with 20,000 waiting (queued) requests; a step must not
cost more with the longer queue.

Each configuration runs --repeats times; per measure the smallest of the runs' medians is
kept (the 2-core machine is shared: the other runs only add noise).

  python bench/driver_cost.py [--running 16 64 256] [--prompt-len 512] [--steps 200]
                              [--repeats 3] [--queued 500 20000] [--stream]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from bench.common import save  # noqa: E402
from ray_runtime.config import EngineConfig, default_inflight_steps  # noqa: E402
from ray_runtime.digest import rows_hash  # noqa: E402
from ray_runtime.echo_ranks import EchoRanks  # noqa: E402
from ray_runtime.engine_core import EngineCore  # noqa: E402
from ray_runtime.messages import RequestSpec, StepPlan  # noqa: E402
from ray_runtime.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

MODES = {"sync": (False, 1), "pp1_async": (True, 1), "pp2": (True, 2)}  # async_scheduling, PP
BLOCK_SIZE = 16
PHASES = ("plan", "decode", "audit", "commit", "pop", "other")


class Timed:
    """Wraps a bound method of `obj` so that its calls' time adds up in `self.s`."""

    def __init__(self, obj, attr: str) -> None:
        fn = getattr(obj, attr)
        self.s = 0.0

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s += time.perf_counter() - t0

        setattr(obj, attr, timed)


def make_engine(n_running: int, n_waiting: int, prompt_len: int, steps: int, mode: str,
                stream: bool = False, seed: int = 0) -> EngineCore:
    """n_running requests that will decode for the whole run; n_waiting more behind them
    that max_num_seqs keeps queued."""
    async_scheduling, pp = MODES[mode]
    max_len = prompt_len + steps + 64
    blocks = n_running * (max_len // BLOCK_SIZE + 2)
    cfg = EngineConfig(model="(none: EchoRanks)", pipeline_parallel_size=pp,
                       async_scheduling=async_scheduling, max_num_seqs=n_running,
                       max_num_batched_tokens=max(n_running, 8192), block_size=BLOCK_SIZE,
                       num_kv_blocks=blocks, max_model_len=max_len, disable_log_stats=True,
                       on_mismatch="raise")
    core = EngineCore(cfg, EchoRanks(pp), num_kv_blocks=blocks, max_model_len=max_len,
                      eos_token_ids=[])
    rng = np.random.default_rng(seed)
    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    sp = SamplingParams(max_tokens=steps + 32, temperature=0.0, ignore_eos=True, output_kind=kind)
    for i in range(n_running + n_waiting):
        core.add_request(RequestSpec(str(i), rng.integers(3, 30000, prompt_len).tolist(), sp))
    return core


def _steady(plan: StepPlan) -> bool:
    """Steady decode: every scheduled request one token, no admission."""
    return not plan.new_reqs and plan.total_num_scheduled_tokens == len(plan.scheduled_req_ids)


def drive(core: EngineCore, steps: int, queued: bool = False) -> dict:
    """EngineCore.step() until `steps` steps of steady decode were timed: steps that sent one
    plan and completed one, both steady decode, with no request waiting unless `queued`
    (prefill and mixed steps not counted). Each phase's time is read from the core's own
    counters (plan_s, wait_s, audit_s) and from wrappers on the scheduler's commit and
    pop_finished; the echo ranks' time is taken out of plan (send_plan) and of the step."""
    echo: EchoRanks = core.ranks
    commit, pop = Timed(core.scheduler, "update_from_output"), Timed(core.scheduler, "pop_finished")
    t = {k: [] for k in PHASES + ("step", "reqs", "bytes")}
    untimed = 0
    while len(t["step"]) < steps:
        before = (core.plan_s, core.wait_s, core.audit_s, commit.s, pop.s, echo.rank_s,
                  echo.num_plans, echo.last_read_plan)
        t0 = time.perf_counter()
        core.step()
        wall = time.perf_counter() - t0
        plan_s, wait_s, audit_s, commit_s, pop_s, rank_s, num_plans, last_read = before
        read = echo.last_read_plan
        timed = (echo.num_plans == num_plans + 1 and read is not last_read
                 and _steady(echo.last_sent_plan) and _steady(read)
                 and (queued or not core.scheduler.waiting))
        if not timed:
            untimed += 1
            assert untimed < 10 * steps, "never reached steady decode"
            continue
        rank = echo.rank_s - rank_s
        step = wall - rank
        ph = {"plan": core.plan_s - plan_s - rank, "decode": core.wait_s - wait_s,
              "audit": core.audit_s - audit_s, "commit": commit.s - commit_s,
              "pop": pop.s - pop_s}
        # the rest of step(): deltas, trace spans, freeing the step's record and replies
        ph["other"] = step - sum(ph.values())
        for k, v in ph.items():
            t[k].append(v)
        t["step"].append(step)
        t["reqs"].append(len(read.scheduled_req_ids))
        t["bytes"].append(echo.last_sent_nbytes)
    assert core.num_mismatches == 0
    us = {k: 1e6 * float(np.median(t[k])) for k in PHASES + ("step",)}
    us["step_mean"] = 1e6 * float(np.mean(t["step"]))
    return {"us": us, "reqs": float(np.median(t["reqs"])), "bytes": int(np.median(t["bytes"]))}


def inflight_of(mode: str) -> int:
    async_scheduling, pp = MODES[mode]
    return default_inflight_steps(pp) if async_scheduling else 1


def best_of(fn, repeats: int) -> dict:
    """Per measure, the smallest median over `repeats` runs."""
    runs = [fn() for _ in range(repeats)]
    best = dict(runs[0])
    best["us"] = {k: min(r["us"][k] for r in runs) for k in runs[0]["us"]}
    return best


def rank_digest_ms(n: int, prompt_len: int) -> float:
    """A rank's side, for comparison: its digest of n rows of ~prompt_len tokens."""
    rows = np.zeros((n, prompt_len + 64), np.int64)
    lengths = np.full(n, prompt_len + 32, np.int64)
    ts = []
    for _ in range(50):
        t0 = time.perf_counter()
        rows_hash(rows, np.arange(n), lengths)
        ts.append(time.perf_counter() - t0)
    return round(1e3 * float(np.median(ts)), 4)


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x: (a, b)."""
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(a), float(b)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--running", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--queued", type=int, nargs="*", default=[500, 20000])
    p.add_argument("--queued-running", type=int, default=4)
    p.add_argument("--stream", action="store_true",
                   help="requests report every step's tokens (DELTA), not only the final output")
    args = p.parse_args()

    rows, fits = [], {}
    for mode, (async_scheduling, pp) in MODES.items():
        inflight = inflight_of(mode)
        mode_rows = []
        for n in args.running:
            def once(n=n, mode=mode, inflight=inflight):
                core = make_engine(n, 0, args.prompt_len, args.steps * inflight + 64, mode,
                                   args.stream)
                return drive(core, args.steps)
            r = best_of(once, args.repeats)
            us = r["us"]
            row = {"mode": mode, "running": n, "scheduled_per_step": r["reqs"],
                   "plan_ms": round(us["plan"] / 1e3, 4), "commit_ms": round(us["commit"] / 1e3, 4),
                   "audit_ms_per_rank": round(us["audit"] / pp / 1e3, 4),
                   "pop_finished_ms": round(us["pop"] / 1e3, 4),
                   "reply_decode_ms": round(us["decode"] / 1e3, 4),
                   "other_ms": round(us["other"] / 1e3, 4),
                   "step_ms": round(us["step"] / 1e3, 4),
                   "step_mean_ms": round(us["step_mean"] / 1e3, 4),
                   "us_per_scheduled_request": round(us["step"] / r["reqs"], 3),
                   "plan_bytes": r["bytes"]}
            if mode == "sync":
                row["rank_digest_ms"] = rank_digest_ms(n, args.prompt_len)
            mode_rows.append(row)
            rows.append(row)
        xs = [r["scheduled_per_step"] for r in mode_rows]
        f = {}
        for key, col in (("step", "step_ms"), ("plan", "plan_ms"), ("commit", "commit_ms"),
                         ("audit", "audit_ms_per_rank")):
            a, b = fit(xs, [1e3 * r[col] for r in mode_rows])
            f[f"{key}_fixed_us"] = round(a, 2)
            f[f"{key}_us_per_request"] = round(b, 3)
        f["meets_target"] = bool(f["step_us_per_request"] <= 2.0 and f["step_fixed_us"] <= 100.0)
        fits[mode] = f

    queued = []
    for w in args.queued:
        def once_q(w=w):
            core = make_engine(args.queued_running, w, 32, args.steps + 64, "sync", args.stream)
            return drive(core, args.steps, queued=True)
        r = best_of(once_q, args.repeats)
        queued.append({"waiting": w, "running": args.queued_running,
                       "step_us": round(r["us"]["step"], 2),
                       "pop_finished_us": round(r["us"]["pop"], 2)})

    print(f"{'mode':>10} {'running':>7} {'sched/step':>10} {'plan ms':>8} {'commit ms':>9} "
          f"{'audit ms/rank':>13} {'pop ms':>7} {'decode ms':>9} {'other ms':>8} {'step ms':>8} "
          f"{'us/req':>7} {'plan bytes':>10}")
    for r in rows:
        print(f"{r['mode']:>10} {r['running']:>7} {r['scheduled_per_step']:>10} {r['plan_ms']:>8} "
              f"{r['commit_ms']:>9} {r['audit_ms_per_rank']:>13} {r['pop_finished_ms']:>7} "
              f"{r['reply_decode_ms']:>9} {r['other_ms']:>8} "
              f"{r['step_ms']:>8} {r['us_per_scheduled_request']:>7} {r['plan_bytes']:>10}")
    for mode, f in fits.items():
        print(f"{mode:>10}: per step = {f['step_fixed_us']} us + {f['step_us_per_request']} us x "
              f"scheduled requests (plan {f['plan_us_per_request']}, commit "
              f"{f['commit_us_per_request']}, audit {f['audit_us_per_request']} per rank); "
              f"target <= 100 us + 2 us x n: {'met' if f['meets_target'] else 'MISSED'}")
    for q in queued:
        print(f"queue: {q['running']} running, {q['waiting']:>6} waiting: step {q['step_us']} us "
              f"(pop_finished {q['pop_finished_us']} us)")
    queue_ratio = None
    if len(queued) >= 2:
        queue_ratio = round(queued[-1]["step_us"] / queued[0]["step_us"], 3)
        print(f"queue: {queued[-1]['waiting']} / {queued[0]['waiting']} waiting = "
              f"{queue_ratio}x per step")
    path = save("driver_cost", {
        "workload": {"prompt_len": args.prompt_len, "decode_steps": args.steps,
                     "repeats": args.repeats, "stream": args.stream,
                     "note": "steady decode; per measure the smallest median over the repeats; "
                             "step = EngineCore.step() over EchoRanks less the echo's own time: "
                             "plan (schedule + encode) + reply decode + every rank's audit + "
                             "commit + pop_finished + other (deltas, trace spans); "
                             "fit: step = fixed + per_request x scheduled requests",
                     "modes": {m: {"async_scheduling": a, "pipeline_parallel_size": pp,
                                   "placeholders": a and pp == 1, "inflight": inflight_of(m)}
                               for m, (a, pp) in MODES.items()}},
        "rows": rows, "fit": fits, "queued": queued, "queue_ratio": queue_ratio})
    print("wrote", path)


if __name__ == "__main__":
    main()
