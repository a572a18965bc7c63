"""Where a stage's time goes, from the traces of stages/profiling.py. Host: per step phase
(the named ranges), its count and mean ("wait for plan" counts each poll of the channel); the costliest CPU ops and CUDA runtime calls (a
cudaStreamSynchronize or cudaMemcpy under the step's launch is a host stall). Device: the
busiest stream's (the compute stream's) busy fraction over the window, its gaps, and its
kernels' time per step.

  python bench/profile_summary.py DIR_OR_FILES... [--top 12] [--json OUT]
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def summarize(path: str, top: int) -> dict:
    events = load(path)
    phases = collections.defaultdict(list)
    ops = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "user_annotation":
            phases[e["name"]].append(e["dur"] / 1e3)
        elif e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver"):
            ops[e["name"]].append(e["dur"] / 1e3)
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    device = _device(kernels, len(phases.get("launch", [])), top) if kernels else None
    spans = [e for e in events if e.get("cat") == "user_annotation"]
    window = (max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)) / 1e3 \
        if spans else 0.0
    return {"file": os.path.basename(path), "window_ms": round(window, 1),
            "phases_ms": {k: {"n": len(v), "mean": round(sum(v) / len(v), 3),
                              "total": round(sum(v), 1)} for k, v in phases.items()},
            "top_ops_ms": {k: {"n": len(v), "total": round(sum(v), 1)} for k, v in
                           sorted(ops.items(), key=lambda kv: -sum(kv[1]))[:top]},
            "device": device}


def _device(kernels: list[dict], steps: int, top: int) -> dict:
    by_stream = collections.defaultdict(list)
    for e in kernels:
        by_stream[e["args"].get("stream")].append(e)
    # The compute stream: the most kernel time that is not NCCL's (a send posted early spins
    # on its stream until the peer receives, so NCCL's stream can look the busiest).
    stream, ks = max(by_stream.items(), key=lambda kv: sum(
        e["dur"] for e in kv[1] if not e["name"].startswith("nccl")))
    ks.sort(key=lambda e: e["ts"])
    span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
    gaps = [b["ts"] - a["ts"] - a["dur"] for a, b in zip(ks, ks[1:])]
    per_kernel = collections.defaultdict(float)
    for e in ks:
        per_kernel[e["name"][:80]] += e["dur"]
    steps = max(steps, 1)
    return {"compute_stream": stream, "window_ms": round(span / 1e3, 2),
            "busy_fraction": round(sum(e["dur"] for e in ks) / span, 3) if span > 0 else None,
            "gaps_over_30us": sum(g > 30 for g in gaps),
            "gap_ms_over_30us": round(sum(g for g in gaps if g > 30) / 1e3, 2),
            "steps": steps, "kernel_ms_per_step": round(sum(e["dur"] for e in ks) / steps / 1e3, 3),
            "top_kernels_ms_per_step": {k: round(v / steps / 1e3, 3) for k, v in
                                        sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]},
            "other_streams": {str(s): {"kernels": len(v), "top": collections.Counter(
                e["name"][:60] for e in v).most_common(2)} for s, v in by_stream.items()
                if s != stream}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("paths", nargs="+")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--json", default=None, help="also write the summaries there")
    args = p.parse_args()
    files = []
    for path in args.paths:
        files += sorted(glob.glob(os.path.join(path, "stage*.json*"))) if os.path.isdir(path) \
            else [path]
    summaries = [summarize(f, args.top) for f in files]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries, f, indent=1)
    for s in summaries:
        print(f"{s['file']}: window {s['window_ms']} ms")
        for name, v in sorted(s["phases_ms"].items(), key=lambda kv: -kv[1]["total"]):
            print(f"  {name:<20} n={v['n']:>4}  mean {v['mean']:7.3f} ms  total {v['total']:8.1f} ms")
        for name, v in s["top_ops_ms"].items():
            print(f"    {name[:48]:<48} n={v['n']:>5}  total {v['total']:8.1f} ms")
        d = s["device"]
        if d:
            print(f"  device: stream {d['compute_stream']} busy {d['busy_fraction']} of "
                  f"{d['window_ms']} ms, {d['kernel_ms_per_step']} ms of kernels per step, "
                  f"{d['gaps_over_30us']} gaps > 30 us ({d['gap_ms_over_30us']} ms)")
            for name, v in d["top_kernels_ms_per_step"].items():
                print(f"    {v:7.3f} ms/step  {name}")


if __name__ == "__main__":
    main()
