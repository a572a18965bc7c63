"""Where a stage's host time goes, from the traces of stages/profiling.py: per step phase
(the named ranges), its count and mean; then the costliest CPU ops and CUDA runtime calls
(a cudaStreamSynchronize or cudaMemcpy under the step's launch is a host stall).

  python bench/profile_summary.py DIR_OR_FILES... [--top 12]
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
    spans = [e for e in events if e.get("cat") == "user_annotation"]
    window = (max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)) / 1e3 \
        if spans else 0.0
    return {"file": os.path.basename(path), "window_ms": round(window, 1),
            "phases_ms": {k: {"n": len(v), "mean": round(sum(v) / len(v), 3),
                              "total": round(sum(v), 1)} for k, v in phases.items()},
            "top_ops_ms": {k: {"n": len(v), "total": round(sum(v), 1)} for k, v in
                           sorted(ops.items(), key=lambda kv: -sum(kv[1]))[:top]}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("paths", nargs="+")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    files = []
    for path in args.paths:
        files += sorted(glob.glob(os.path.join(path, "stage*.json*"))) if os.path.isdir(path) \
            else [path]
    for f in files:
        s = summarize(f, args.top)
        print(f"{s['file']}: window {s['window_ms']} ms")
        for name, v in sorted(s["phases_ms"].items(), key=lambda kv: -kv[1]["total"]):
            print(f"  {name:<20} n={v['n']:>4}  mean {v['mean']:7.3f} ms  total {v['total']:8.1f} ms")
        for name, v in s["top_ops_ms"].items():
            print(f"    {name[:48]:<48} n={v['n']:>5}  total {v['total']:8.1f} ms")


if __name__ == "__main__":
    main()
