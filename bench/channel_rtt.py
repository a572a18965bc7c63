"""The control plane's round trip, driver -> stage -> driver, on one node: a plan's bytes out
and a result's bytes back, through the stage's real StepLoop over its channel, against the
same exchange as a Ray actor call (what each step cost before the channel).

  python bench/channel_rtt.py [--reqs 1 64 256] [--iters 2000]

The stage's runner is a stand-in that answers at once (no model): what is timed is the
transport, framing, msgspec decode/encode and the loop, not the step's work.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import save  # noqa: E402


class EchoRunner:
    """Answers every plan at once with a result of one digest per scheduled request."""

    rank = 0

    def launch(self, plan):
        return plan

    def step_done(self, step) -> bool:
        return True

    def finish(self, plan):
        from ray_runtime.messages import RowDigests, StageStepResult, StageTiming

        now = time.time()
        n = len(plan.scheduled_req_ids)
        digests = RowDigests(list(plan.scheduled_req_ids), [1] * n, [300] * n, [300] * n,
                             [299] * n, [12345678901234] * n, [0] * n, [0] * n)
        return StageStepResult(plan.step_id, 0, StageTiming(now, now, now, now, 0.0), digests)


class EchoStage:
    def open_channel(self):
        import ray

        from stages.step_loop import StepLoop

        self.loop = StepLoop(EchoRunner(), ray.util.get_node_ip_address())
        return self.loop.address

    def execute(self, plan_bytes: bytes) -> bytes:
        from ray_runtime.messages import decode_plan, encode

        runner = EchoRunner()
        return encode(runner.finish(runner.launch(decode_plan(plan_bytes))))


def plan_bytes(num_reqs: int, step: int) -> bytes:
    from ray_runtime.messages import CachedRequest, CachedRequestData, StepPlan, encode

    cached = CachedRequestData.of([CachedRequest(f"req-{i}", 300, [1234], [], 299)
                                   for i in range(num_reqs)])
    return encode(StepPlan(step, [], [], cached, list(cached.req_ids), [1] * num_reqs))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reqs", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args()
    import ray

    from ray_runtime.channel import PLAN, RESULT, Channel

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    stage = ray.remote(num_cpus=1)(EchoStage).remote()
    host, port = ray.get(stage.open_channel.remote())
    chan = Channel.connect(host, port, peer="echo stage")
    rows = []
    for n in args.reqs:
        data = plan_bytes(n, 0)
        chan_us, actor_us = [], []
        for i in range(args.iters):
            t0 = time.perf_counter()
            chan.send(PLAN, data)
            kind, _ = chan.recv()
            chan_us.append((time.perf_counter() - t0) * 1e6)
            assert kind == RESULT
        for i in range(min(args.iters, 500)):
            t0 = time.perf_counter()
            ray.get(stage.execute.remote(data))
            actor_us.append((time.perf_counter() - t0) * 1e6)
        skip = len(chan_us) // 10  # warm-up
        row = {"scheduled_requests": n, "plan_bytes": len(data),
               "channel_rtt_us_p50": round(statistics.median(chan_us[skip:]), 1),
               "channel_rtt_us_p99": round(sorted(chan_us[skip:])[int(0.99 * (len(chan_us) - skip))], 1),
               "actor_call_rtt_us_p50": round(statistics.median(actor_us[len(actor_us) // 10:]), 1)}
        row["speedup"] = round(row["actor_call_rtt_us_p50"] / row["channel_rtt_us_p50"], 1)
        rows.append(row)
        print(row)
    chan.close()
    ray.shutdown()
    path = save("channel_rtt" + os.environ.get("BENCH_TAG", ""),
                {"workload": {"iters": args.iters, "note": "echo stage on the same node; "
                              "plan of n one-token decode entries, result of n digests"},
                 "rows": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
