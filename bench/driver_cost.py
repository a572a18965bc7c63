"""The driver's own cost per step, without Ray or a model: planning (schedule + msgpack
encode of the plan), committing a sampler output, and the audit of one rank's digests,
at 16, 64 and 256 running requests in steady decode.

  python bench/driver_cost.py [--running 16 64 256] [--prompt-len 512] [--steps 200]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from bench.common import save  # noqa: E402
from ray_runtime.digest import rows_hash  # noqa: E402
from ray_runtime.messages import RowDigest, SamplerOutput, encode  # noqa: E402
from ray_runtime.reconcile import audit  # noqa: E402
from ray_runtime.request import Request  # noqa: E402
from ray_runtime.sampling_params import SamplingParams  # noqa: E402
from ray_runtime.scheduler import Scheduler  # noqa: E402


def measure(n: int, prompt_len: int, steps: int) -> dict:
    bs = 16
    sched = Scheduler(max_num_seqs=n, max_num_batched_tokens=max(n, 8192), block_size=bs,
                      num_kv_blocks=n * ((prompt_len + steps + 2 * bs) // bs + 1),
                      max_model_len=prompt_len + steps + 64)
    rng = np.random.default_rng(0)
    for i in range(n):
        sched.add_request(Request(str(i), rng.integers(3, 30000, prompt_len).tolist(),
                                  SamplingParams(max_tokens=steps + 10, temperature=0.0, ignore_eos=True),
                                  frozenset(), i))
    # Rank-side digest cost: the same hash a rank computes over its rows each step.
    rows = np.zeros((n, prompt_len + steps + 64), np.int64)
    plan_s, commit_s, audit_s, digest_s, plan_bytes = [], [], [], [], []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        rec = sched.schedule()
        data = encode(rec.plan)
        t1 = time.perf_counter()
        ids = rec.plan.scheduled_req_ids
        t2 = time.perf_counter()
        lengths = np.array([rec.expected[r].num_tokens_known for r in ids], np.int64)
        hashes = rows_hash(rows, np.arange(len(ids)), lengths)
        t3 = time.perf_counter()
        digests = [RowDigest(r, rec.expected[r].incarnation, rec.expected[r].num_tokens_known,
                             rec.expected[r].num_tokens_known, rec.expected[r].num_computed_tokens,
                             rec.expected[r].token_hash, 0) for r in ids]
        t4 = time.perf_counter()
        audit(rec.expected, digests, rank=0, is_last=False)  # mismatches expected: fake rows
        t5 = time.perf_counter()
        out = SamplerOutput(step_id=rec.plan.step_id, req_ids=ids,
                            incarnations=[rec.incarnations[r] for r in ids],
                            sampled_token_ids=[[7] for _ in ids])
        t6 = time.perf_counter()
        sched.update_from_output(rec, out)
        t7 = time.perf_counter()
        if step > 0:  # step 0 is the prefill of every prompt
            plan_s.append(t1 - t0)
            digest_s.append(t3 - t2)
            audit_s.append(t5 - t4)
            commit_s.append(t7 - t6)
            plan_bytes.append(len(data))
        del hashes
    ms = lambda xs: round(1e3 * float(np.median(xs)), 4)  # noqa: E731
    return {"running": n, "plan_ms": ms(plan_s), "commit_ms": ms(commit_s),
            "audit_ms_per_rank": ms(audit_s), "rank_digest_ms": ms(digest_s),
            "plan_bytes": int(np.median(plan_bytes))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--running", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    rows = [measure(n, args.prompt_len, args.steps) for n in args.running]
    print(f"{'running':>8} {'plan ms':>8} {'commit ms':>9} {'audit ms/rank':>13} "
          f"{'rank digest ms':>14} {'plan bytes':>10}")
    for r in rows:
        print(f"{r['running']:>8} {r['plan_ms']:>8} {r['commit_ms']:>9} {r['audit_ms_per_rank']:>13} "
              f"{r['rank_digest_ms']:>14} {r['plan_bytes']:>10}")
    path = save("driver_cost", {"workload": {"prompt_len": args.prompt_len, "decode_steps": args.steps,
                                             "note": "steady decode, medians per step"},
                                "rows": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
