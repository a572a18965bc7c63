"""Where a pipeline's device time goes between stages, from a pipeline trace written with the
phase clock on (RAY_RUNTIME_PHASE_CLOCK=1 and --trace-dir in bench/pp_scaling.py: each stage's
device spans on the hosts' time axis, stages/profiling.py). Over the steady middle half of
the steps, medians in ms:

  gpu_ms            a stage's device time per step
  gap_before_ms     its device idle before a step (after its previous one)
  hop_ms[k]         stage k's device end -> stage k+1's device start, same step: the transfer,
                    plus waiting for stage k+1's host when that is late
  feedback_ms       the last stage's device end of step s -> rank 0's device start of the
                    micro-batch's next step (s + PP steps later with PP micro-batches)
  host_lead_ms      a stage's device start - its host's launch start, same step: near 0 means
                    the device waited for its host (the host sets the pace)
and window_idle_fraction, per stage: 1 - its device's busy time over the window's wall time;
fed_from_lag: how many steps back the step whose fed-back samples each of rank 0's steps
waited for lies ({lag: steps}; with PP micro-batches, PP: the micro-batch's previous step).

last_call: the whole of the trace's last generate call (the steps planned after the
engine's last "busy" mark, when it took up work after idling), per stage, as fractions of
its wall time (rank 0's first device start to the last stage's last device end): busy and
idle in prefill steps and in decode steps (a prefill step: the plan's `prefill_shaped`, fewer
than half of its tokens get logits; in traces before it, at least half are prompt tokens; idle is the gap before a step,
charged to that step), fill (before the stage's first step) and drain (after its last);
lead_ms: from the busy mark to the first plan, and from it to rank 0's first device start;
window_epoch_ms: the window's ends (epoch ms), for a caller that timed the call itself.

  python bench/pipeline_timeline.py TRACE.json [--json OUT]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ray_runtime.trace import GPU_TID  # noqa: E402


def spans(events: list[dict]) -> tuple[dict, dict]:
    """Per rank {step: (start_ms, end_ms)} of the device, and of the host's launch (from
    its first span of the step, "recv wait" or rank 0's "prepare", to the "compute" end)."""
    gpu, host = collections.defaultdict(dict), collections.defaultdict(dict)
    for e in events:
        if e.get("ph") != "X" or "step" not in e.get("args", {}):
            continue
        step, t0, t1 = e["args"]["step"], e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3
        if e["tid"] >= GPU_TID:
            gpu[e["tid"] - GPU_TID][step] = (t0, t1)
        elif e["tid"] >= 1 and e["name"] in ("recv wait", "prepare", "token wait", "compute"):
            prev = host[e["tid"] - 1].get(step)
            host[e["tid"] - 1][step] = (min(t0, prev[0]) if prev else t0,
                                        t1 if e["name"] == "compute" else (prev or (t0, t1))[1])
    return gpu, host


def timeline(events: list[dict]) -> dict:
    gpu, host = spans(events)
    if not gpu:
        raise ValueError("no device spans in the trace: run with RAY_RUNTIME_PHASE_CLOCK=1 on CUDA")
    pp = max(gpu) + 1
    steps = sorted(gpu[pp - 1])
    window = range(steps[len(steps) // 4], steps[3 * len(steps) // 4])

    def med(values) -> float | None:
        values = list(values)
        return round(statistics.median(values), 3) if values else None

    def both(a: dict, sa: int, b: dict, sb: int) -> bool:
        return sa in a and sb in b

    return {
        "pp": pp, "steps": len(steps), "window": [window.start, window.stop],
        "gpu_ms": [med(gpu[k][s][1] - gpu[k][s][0] for s in window if s in gpu[k])
                   for k in range(pp)],
        "gap_before_ms": [med(gpu[k][s][0] - gpu[k][s - 1][1] for s in window
                              if both(gpu[k], s, gpu[k], s - 1)) for k in range(pp)],
        "hop_ms": [med(gpu[k + 1][s][0] - gpu[k][s][1] for s in window
                       if both(gpu[k], s, gpu[k + 1], s)) for k in range(pp - 1)],
        "feedback_ms": med(gpu[0][s + pp][0] - gpu[pp - 1][s][1] for s in window
                           if both(gpu[pp - 1], s, gpu[0], s + pp)) if pp > 1 else None,
        "host_lead_ms": [med(gpu[k][s][0] - host[k][s][0] for s in window
                             if both(gpu[k], s, host[k], s)) for k in range(pp)],
        "window_idle_fraction": [idle(gpu[k], window) for k in range(pp)],
        "fed_from_lag": fed_from_lags(events, window),
        "last_call": last_call(events, gpu, pp),
    }


def last_call(events: list[dict], gpu: dict, pp: int) -> dict | None:
    """Busy and idle by the kind of step over the last generate call (see the module's doc);
    None for a trace without the engine's "busy" marks or the plans' prompt token counts."""
    marks = [e["ts"] / 1e3 for e in events if e.get("ph") == "i" and e.get("name") == "busy"]
    plans = [(e["ts"] / 1e3, e["args"]) for e in events
             if e.get("ph") == "X" and e.get("tid") == 0 and e.get("name") == "plan"]
    if not marks or not plans or "prompt_tokens" not in plans[0][1]:
        return None
    start = max(marks)  # the engine went busy with the last call's requests
    kind = {a["step"]: "prefill" if a.get("prefill_shaped", 2 * a["prompt_tokens"] >= max(1, a["tokens"]))
            else "decode" for t, a in plans if t >= start}
    steps = sorted(s for s in kind if all(s in gpu[k] for k in range(pp)))
    if not steps:
        return None
    t_start, t_end = gpu[0][steps[0]][0], gpu[pp - 1][steps[-1]][1]
    wall = t_end - t_start
    first_plan = min(t for t, a in plans if t >= start)
    out: dict = {"steps": len(steps), "wall_ms": round(wall, 1),
                 "prefill_steps": sum(kind[s] == "prefill" for s in steps),
                 "window_epoch_ms": [round(t_start, 2), round(t_end, 2)],
                 # before the window: the busy mark to the first plan, that plan to rank 0's device
                 "lead_ms": {"busy_to_plan": round(first_plan - start, 2),
                             "plan_to_device": round(t_start - first_plan, 2)}}
    for k in range(pp):
        acc = collections.Counter()
        prev_end = None
        for s in steps:
            t0, t1 = gpu[k][s]
            acc[kind[s] + "_busy"] += t1 - t0
            if prev_end is None:
                acc["fill"] += t0 - t_start
            else:
                acc[kind[s] + "_idle"] += max(0.0, t0 - prev_end)
            prev_end = t1
        acc["drain"] += t_end - prev_end
        out[f"stage{k}"] = {key: round(acc[key] / wall, 3) for key in
                            ("prefill_busy", "prefill_idle", "decode_busy", "decode_idle",
                             "fill", "drain")}
    return out


def fed_from_lags(events: list[dict], window: range) -> dict[int, int]:
    """{step - fed_from: count} over rank 0's steps in the window that waited for fed-back
    samples (the trace's `fed_from` on rank 0's spans, ray_runtime/trace.py)."""
    lags: collections.Counter = collections.Counter()
    for e in events:
        a = e.get("args", {})
        if e.get("tid") == 1 and e.get("name") == "compute" and "fed_from" in a \
                and a["step"] in window:
            lags[a["step"] - a["fed_from"]] += 1
    return dict(sorted(lags.items()))


def idle(spans: dict, window: range) -> float | None:
    """1 - the device's busy time over the wall time from its first to its last step of the
    window: the steady state's idle, without ramp-up, prefill at the start or the drain."""
    inside = [spans[s] for s in window if s in spans]
    if len(inside) < 2:
        return None
    wall = max(t1 for _, t1 in inside) - min(t0 for t0, _ in inside)
    return round(1 - sum(t1 - t0 for t0, t1 in inside) / wall, 3)


def load_events(path: str) -> list[dict]:
    """A pipeline trace's events (a .json or .json.gz file)."""
    opener = __import__("gzip").open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    out = {"trace": os.path.basename(args.trace), **timeline(load_events(args.trace))}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
