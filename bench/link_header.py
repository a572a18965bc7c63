"""What the step tag costs: activation transfers between two stages (PP=2, two processes, gloo
on CPU), bare (the activations alone, as before the tags) against step-tagged
(StageTransport, stages/transport.py): "packed" is the CPU format (activations up to
INLINE_BYTES inside the header's message, copied once on the sender; larger ones apart),
"split" the GPU format run over gloo (a header message, then the activations, always).

  python bench/link_header.py [--tokens 1 16 64 256] [--hidden 1024] [--iters 2000] [--out PATH]

Two patterns, rounds of bare and tagged interleaved, reported as the 10th percentile and the
median (a shared, loaded machine inflates the mean; the low percentile is the link's own cost):
- stream: the sender keeps one step's sends outstanding, as a stage does; timed on the
  receiver, one sample per round (its mean time per transfer): the link's throughput.
- pingpong: the sender waits for a one-int ack of each transfer before the next; timed on the
  sender, one sample per transfer: its latency plus the ack's (the same in both variants).
JSON goes to --out, else $BENCH_OUT/link_header.json, else bench/results/link_header.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ACK_TAG = 7
BARE_TAG = 5  # the baseline's own tag: the tagged link keeps a receive posted on its own


def _stage(rank: int, args, port_q, out_q) -> None:
    import torch
    import torch.distributed as dist

    from stages.transport import StageTransport, connect_rendezvous, open_rendezvous

    torch.set_num_threads(1)
    if rank == 0:
        store, port = open_rendezvous("127.0.0.1")
        port_q.put(port)
    else:
        store = connect_rendezvous("127.0.0.1", port_q.get())
    link = StageTransport.connect(rank, 2, "cpu", store, 120.0, args.hidden, torch.float32)
    group = link.group
    # The GPU format (header, then activations), over a group of its own: each transport
    # keeps its next receive posted on its tags.
    split = StageTransport(rank, 2, "cpu", dist.new_group([0, 1]), args.hidden, torch.float32,
                           inline_bytes=0)
    links = {"packed": link, "split": split}
    ack = torch.zeros(1, dtype=torch.int64)
    step = 0

    def run(variant: str, pattern: str, n_tok: int, iters: int) -> list[float]:
        """Seconds per transfer: on the receiver, the round's mean (stream); on the
        sender, each round trip (pingpong)."""
        nonlocal step
        x = torch.randn(n_tok, args.hidden)
        buf = torch.empty(n_tok, args.hidden)
        pending = None
        trips = []
        t0 = time.perf_counter()
        for _ in range(iters):
            step += 1
            if rank == 0:
                t_trip = time.perf_counter()
                if variant != "bare":
                    links[variant].send_to_next(step, x)
                else:  # the old path: one payload, at most one outstanding
                    if pending is not None:
                        pending.wait()
                    pending = group.send([x], 1, BARE_TAG)
                if pattern == "pingpong":
                    group.recv([ack], 1, ACK_TAG).wait()
                    trips.append(time.perf_counter() - t_trip)
            else:
                if variant != "bare":
                    links[variant].recv_from_prev(step, n_tok)
                else:
                    group.recv([buf], 0, BARE_TAG).wait()
                if pattern == "pingpong":
                    group.send([ack], 0, ACK_TAG).wait()
        if rank == 0:
            if variant != "bare":
                links[variant].wait_sends()
            if pending is not None:
                pending.wait()
        return trips if pattern == "pingpong" else [(time.perf_counter() - t0) / iters]

    results = []
    for pattern in ("stream", "pingpong"):
        for n_tok in args.tokens:
            iters = max(50, args.iters * 16 // max(16, n_tok))
            run("bare", pattern, n_tok, iters // 4)  # warm-up
            samples = {"bare": [], "packed": [], "split": []}
            for _ in range(args.rounds):
                for variant in samples:
                    samples[variant] += run(variant, pattern, n_tok, iters)
            if (rank == 0) == (pattern == "pingpong"):  # the side that timed it
                row = {"pattern": pattern, "num_tokens": n_tok, "hidden": args.hidden,
                       "payload_bytes": n_tok * args.hidden * 4, "iters": iters,
                       "rounds": args.rounds}
                for variant, xs in samples.items():
                    xs = sorted(xs)
                    row[f"{variant}_p10_us"] = round(xs[len(xs) // 10] * 1e6, 2)
                    row[f"{variant}_p50_us"] = round(statistics.median(xs) * 1e6, 2)
                for q in ("p10", "p50"):
                    for variant in ("packed", "split"):
                        row[f"{variant}_extra_{q}_us"] = round(
                            row[f"{variant}_{q}_us"] - row[f"bare_{q}_us"], 2)
                results.append(row)
    split.close()
    link.close()
    out_q.put(results)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--hidden", type=int, default=1024)  # Qwen3-0.6B's hidden size
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port_q, out_q = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_stage, args=(r, args, port_q, out_q)) for r in range(2)]
    for p in procs:
        p.start()
    results = out_q.get(timeout=1800) + out_q.get(timeout=600)
    for p in procs:
        p.join(60)
    results.sort(key=lambda r: (r["pattern"] != "stream", r["num_tokens"]))
    for r in results:
        print(f"{r['pattern']:8s} {r['num_tokens']:4d} tok x {r['hidden']}: p10 / p50 us: "
              f"bare {r['bare_p10_us']:.1f} / {r['bare_p50_us']:.1f}, "
              f"packed {r['packed_p10_us']:.1f} / {r['packed_p50_us']:.1f} "
              f"({r['packed_extra_p10_us']:+.1f} / {r['packed_extra_p50_us']:+.1f}), "
              f"split {r['split_p10_us']:.1f} / {r['split_p50_us']:.1f} "
              f"({r['split_extra_p10_us']:+.1f} / {r['split_extra_p50_us']:+.1f})")
    payload = {"backend": "gloo", "pp": 2, "dtype": "float32", "results": results}
    if args.out:
        from bench.common import device_name, git_commit

        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"bench": "link_header", "git_commit": git_commit(), "device": device_name(),
                       "command": "python " + " ".join(sys.argv), **payload}, f, indent=1)
        print(args.out)
    else:
        from bench.common import save

        print(save("link_header", payload))


if __name__ == "__main__":
    main()
