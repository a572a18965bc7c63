"""What drawing a step's tokens costs on the last rank, per sampling setting: Sampler.sample on
[rows, vocab] float32 logits, median over repeats; with --baseline, the same calls on the
stages/sampler.py of another checkout (e.g. `git archive REV | tar -x -C .base`), side by side
in one run. The logprobs setting times Sampler.__call__ (tokens and logprobs read to the host). On CUDA
the time is the host's plus the device's (synchronized after each call);
a sampler that makes the host wait mid-call shows there too.

  python bench/sampler_cost.py [--device cpu] [--rows 256] [--vocab 32000 151936]
                               [--baseline .base] [--repeats 20] [--tag cpu]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import save  # noqa: E402

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top_p": dict(temperature=0.8, top_p=0.95),
    "top_k_top_p": dict(temperature=0.7, top_k=50, top_p=0.9),
    "seeded": dict(temperature=0.8, seed=1),
    # through Sampler.__call__, which also reads the tokens and their logprobs to the host
    "greedy_logprobs_5": dict(temperature=0.0, logprobs=5),
}


def load_sampler(root: str):
    """stages/sampler.py of the checkout at root, as its own module. Its imports of other
    `stages` modules (seeded_noise, staging) resolve to this checkout: a baseline that has
    them times this checkout's versions of them."""
    spec = importlib.util.spec_from_file_location(f"sampler_{abs(hash(root))}",
                                                  os.path.join(root, "stages", "sampler.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod.Sampler


def time_calls(sampler, logits, params, repeats: int, cuda: bool) -> float:
    """Sampler.sample (the draw, left on the device), or Sampler.__call__ (the tokens and
    their logprobs on the host) where the rows ask for logprobs."""
    idx = list(range(len(params)))
    call = sampler if params[0].logprobs is not None else sampler.sample
    times = []
    for _ in range(repeats + 2):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        call(logits, params, idx)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--baseline", default=None, help="a checkout whose sampler runs beside ours")
    p.add_argument("--tag", default="")
    args = p.parse_args()
    from ray_runtime.sampling_params import SamplingParams
    from stages.sampler import Sampler

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    samplers = {"this": Sampler(dev)}
    if args.baseline:
        samplers["baseline"] = load_sampler(args.baseline)(dev)
    rows = []
    for vocab in args.vocab:
        logits = torch.randn(args.rows, vocab, device=dev, generator=None) * 3
        for name, kw in SETTINGS.items():
            params = [SamplingParams(**kw) for _ in range(args.rows)]
            row = {"vocab": vocab, "rows": args.rows, "setting": name, "params": kw}
            for which, s in samplers.items():
                row[f"{which}_ms"] = round(time_calls(s, logits, params, args.repeats, cuda), 3)
            if "baseline_ms" in row:
                row["speedup"] = round(row["baseline_ms"] / row["this_ms"], 2)
            rows.append(row)
            print(row, flush=True)
    print("wrote", save("sampler_cost" + (f"_{args.tag}" if args.tag else ""),
                        {"baseline": args.baseline, "rows_ms": rows}))


if __name__ == "__main__":
    main()
