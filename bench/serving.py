"""Serving benchmark: requests arrive as a Poisson process at several rates, through the
OpenAI-compatible server (ray_runtime/server/, on Ray Serve) as a user meets it, each a
streamed /v1/completions of random prompt token ids, greedy, ignore_eos, with the
`return_token_ids` extra so that every chunk says how many tokens it carries.

  python bench/serving.py [--request-rates 1 4 16 inf] [--num-prompts 64] [--prompt-len 256]
                          [--output-len 128] [-pp 1] [--model DIR] [--tag h100]
  python bench/serving.py --device cpu --dtype float32 --request-rates 4 inf --num-prompts 8 \
                          --prompt-len 16 --output-len 8           # CPU smoke, tiny model
  python bench/serving.py --url http://127.0.0.1:8000 --model-name NAME ...   # a running server

Without --url it starts Ray (or joins RAY_ADDRESS), deploys the server, and shuts it down
after. Without --model: random bf16 weights of the Qwen3-0.6B shape on CUDA (bench/gpu_check.py's
qwen3_dir), a tiny random Llama on CPU.

Per rate (inf: every request at once): TTFT (request sent to the first chunk with a token),
ITL (the gap between consecutive token-carrying chunks, as vLLM's benchmark_serving counts it;
a chunk may carry several tokens when the engine committed them in one poll), TPOT per request
((last - first token time) / (tokens - 1)), end-to-end latency: mean, p50, p99 in ms; request
throughput and output tokens/s over the rate's wall time. JSON is written only when asked
(--save, or $BENCH_OUT set): $BENCH_OUT/serving_<tag>.json, else bench/results/.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import save  # noqa: E402

APP = "ray_pp_bench"


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "p50": None, "p99": None}
    s = sorted(xs)

    def q(p: float) -> float:  # linear interpolation, as numpy's default
        k = (len(s) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"mean": round(1e3 * sum(s) / len(s), 3), "p50": round(1e3 * q(0.5), 3),
            "p99": round(1e3 * q(0.99), 3)}


async def one_request(session, url: str, model: str, prompt: list[int], output_len: int) -> dict:
    """One streamed completion: token counts and times of its chunks."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    times, counts, error = [], [], None
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                error = f"HTTP {r.status}: {(await r.text())[:300]}"
            else:
                async for raw in r.content:  # one SSE line at a time
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = chunk["error"]["message"]
                        break
                    n = sum(len(c.get("token_ids") or ()) for c in chunk["choices"])
                    if n:
                        times.append(time.perf_counter())
                        counts.append(n)
    except Exception as e:  # noqa: BLE001 - counted as a failed request
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    return {"start": t0, "end": end, "times": times, "counts": counts, "error": error}


async def run_rate(url: str, model: str, prompts: list[list[int]], output_len: int,
                   rate: float, seed: int) -> dict:
    import aiohttp  # Ray Serve's own dependency

    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=len(prompts) + 8)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=3600)) as session:
        tasks = []
        t0 = time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(one_request(session, url, model, p, output_len)))
            if rate != math.inf:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return summarize(results, wall, rate)


async def one_request_direct(engine, prompt: list[int], output_len: int, rid: str) -> dict:
    """--direct: one streamed request through AsyncLLM in this process (no HTTP)."""
    from ray_runtime import RequestOutputKind, SamplingParams

    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA, detokenize=False)
    t0 = time.perf_counter()
    times, counts, error = [], [], None
    try:
        async for out in engine.generate({"prompt_token_ids": prompt}, sp, rid):
            n = len(out.outputs[0].token_ids)
            if n:
                times.append(time.perf_counter())
                counts.append(n)
    except Exception as e:  # noqa: BLE001 - counted as a failed request
        error = f"{type(e).__name__}: {e}"
    return {"start": t0, "end": time.perf_counter(), "times": times, "counts": counts,
            "error": error}


async def run_rate_direct(engine, prompts: list[list[int]], output_len: int, rate: float,
                          seed: int) -> dict:
    rng = random.Random(seed)
    tasks = []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        tasks.append(asyncio.create_task(one_request_direct(engine, p, output_len,
                                                            f"{seed}-{i}")))
        if rate != math.inf:
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    return summarize(results, time.perf_counter() - t0, rate)


def summarize(results: list[dict], wall: float, rate: float) -> dict:
    ok = [r for r in results if r["error"] is None and r["times"]]
    ttft = [r["times"][0] - r["start"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    tpot = [(r["times"][-1] - r["times"][0]) / (sum(r["counts"]) - 1)
            for r in ok if sum(r["counts"]) > 1]
    e2e = [r["end"] - r["start"] for r in ok]
    out_tokens = sum(sum(r["counts"]) for r in ok)
    errors = [r["error"] for r in results if r["error"] is not None]
    return {"request_rate": "inf" if rate == math.inf else rate, "num_requests": len(results),
            "completed": len(ok), "failed": len(results) - len(ok), "errors": errors[:3],
            "duration_s": round(wall, 3), "request_throughput": round(len(ok) / wall, 3),
            "output_tok_s": round(out_tokens / wall, 1), "output_tokens": out_tokens,
            "ttft_ms": percentiles(ttft), "itl_ms": percentiles(itl),
            "tpot_ms": percentiles(tpot), "e2e_ms": percentiles(e2e),
            "mean_tokens_per_chunk": round(out_tokens / max(1, sum(len(r["counts"]) for r in ok)), 3)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_model(args) -> str:
    if args.model:
        return args.model
    if args.device == "cuda":
        import torch

        from bench.gpu_check import qwen3_dir

        return qwen3_dir(args.root, 28, torch.bfloat16, small=False)
    from bench.common import tiny_llama

    return tiny_llama(os.path.join(args.root, "llama_serving_tiny"), hidden=64, layers=2,
                      heads=2, kv_heads=1, intermediate=192, vocab=512)


def start_server(args, model: str) -> str:
    """Ray (joined or local) and the Serve app; returns the base URL."""
    import ray
    from ray import serve

    from ray_runtime.server.app import build_app

    if not ray.is_initialized():  # joins RAY_ADDRESS if set, else a local cluster
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        if os.environ.get("RAY_ADDRESS"):
            ray.init()
        else:
            from bench.common import gpu_ray_env

            # the workers import this checkout, and whatever PYTHONPATH already held
            path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
            ray.init(address="local", include_dashboard=False,
                     runtime_env={"env_vars": {**gpu_ray_env(), "PYTHONPATH": path}})
    port = args.port or free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({
        "model": model, "pipeline_parallel_size": args.pipeline_parallel_size,
        "device": args.device, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.prompt_len + args.output_len, "served_model_name": "bench",
        "max_ongoing_requests": max(256, 2 * args.num_prompts)}), name=APP, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--request-rates", nargs="+", default=["1", "4", "16", "inf"],
                   help="requests/s of the Poisson arrivals; inf: all at once")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per rate")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", default=None, help="a running server; default: start one here")
    p.add_argument("--model-name", default=None, help="with --url: the served model name")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="prompt ids are drawn from [3, vocab); default: the model's, or 256 with --url")
    p.add_argument("--model", default=None)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--root", default="/tmp/ray_runtime_gpu")
    p.add_argument("--tag", default=None, help="results file serving_<tag>.json; default: the device")
    p.add_argument("--direct", action="store_true",
                   help="drive AsyncLLM in this process (no HTTP, no Ray Serve): the engine alone")
    p.add_argument("--save", action="store_true", help="write the JSON (also when $BENCH_OUT is set)")
    args = p.parse_args(argv)
    try:
        rates = [math.inf if r == "inf" else float(r) for r in args.request_rates]
    except ValueError:
        p.error(f"--request-rates: numbers or inf, got {args.request_rates}")
    if any(r <= 0 for r in rates) or args.num_prompts < 1 or args.prompt_len < 1 or args.output_len < 1:
        p.error("--request-rates, --num-prompts, --prompt-len and --output-len must be positive")

    if args.direct and args.url:
        p.error("--direct drives an engine in this process: it takes no --url")
    model_info, started = {"served_at": args.url}, False
    if args.url:
        url, model_name = args.url.rstrip("/"), args.model_name
        vocab = args.vocab_size or 256
    else:
        model = default_model(args)
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
        vocab = args.vocab_size or cfg["vocab_size"]
        model_info = {"dir": os.path.basename(model.rstrip("/")), "architecture": cfg["architectures"][0],
                      "layers": cfg["num_hidden_layers"], "hidden": cfg["hidden_size"],
                      "vocab": cfg["vocab_size"], "dtype": args.dtype,
                      "weights": args.model or "random"}
        if not args.direct:
            url, model_name, started = start_server(args, model), "bench", True
    if args.direct:
        return run_direct(args, model, vocab, model_info)
    rng = random.Random(args.seed)
    rows = []
    try:
        # Warm-up: every prompt shape once (kernels compile per shape on CUDA).
        warm = make_prompts(rng, vocab, 2, args.prompt_len)
        asyncio.run(run_rate(url, model_name, warm, min(args.output_len, 4), math.inf, args.seed))
        for i, rate in enumerate(rates):
            prompts = make_prompts(rng, vocab, args.num_prompts, args.prompt_len)
            row = asyncio.run(run_rate(url, model_name, prompts, args.output_len, rate,
                                       args.seed + i))
            rows.append(row)
            print_row(row)
    finally:
        if started:
            import ray
            from ray import serve

            serve.delete(APP)
            if not serve.status().applications:
                serve.shutdown()
            ray.shutdown()
    return report(args, model_info, rows,
                  "the OpenAI-compatible server on Ray Serve (/v1/completions, stream)")


def make_prompts(rng: random.Random, vocab: int, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def print_row(row: dict) -> None:
    print(f"rate {row['request_rate']:>5}: {row['completed']}/{row['num_requests']} ok "
          f"in {row['duration_s']:.2f}s, {row['request_throughput']:.2f} req/s, "
          f"{row['output_tok_s']:.1f} tok/s; TTFT p50 {row['ttft_ms']['p50']} p99 "
          f"{row['ttft_ms']['p99']} ms; ITL p50 {row['itl_ms']['p50']} p99 "
          f"{row['itl_ms']['p99']} ms", flush=True)


def report(args, model_info: dict, rows: list[dict], through: str) -> dict:
    """The run's JSON payload; written when asked (--save or $BENCH_OUT)."""
    tag = args.tag or ("cpu" if args.device == "cpu" else "gpu")
    payload = {"model": model_info, "workload": {
        "through": through,
        "request_rates": args.request_rates, "num_prompts": args.num_prompts,
        "prompt_len": args.prompt_len, "output_len": args.output_len, "greedy": True,
        "ignore_eos": True, "pp": args.pipeline_parallel_size, "device": args.device,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "seed": args.seed}, "rows": rows}
    if args.save or os.environ.get("BENCH_OUT"):
        print("wrote", save(f"serving_{tag}", payload))
    return payload


def run_direct(args, model: str, vocab: int, model_info: dict) -> dict:
    """--direct: the same load through AsyncLLM in this process, no HTTP and no Ray Serve."""
    import ray

    from bench.common import gpu_ray_env
    from ray_runtime import AsyncLLM

    ray.init(include_dashboard=False, runtime_env={"env_vars": gpu_ray_env()})
    engine = AsyncLLM(model, pipeline_parallel_size=args.pipeline_parallel_size,
                      device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      max_model_len=args.prompt_len + args.output_len + 16)
    rng = random.Random(args.seed)
    rows = []

    async def all_rates():
        warm = make_prompts(rng, vocab, 2, args.prompt_len)
        await run_rate_direct(engine, warm, min(args.output_len, 4), math.inf, 10_000)
        for i, rate in enumerate(rates):
            prompts = make_prompts(rng, vocab, args.num_prompts, args.prompt_len)
            row = await run_rate_direct(engine, prompts, args.output_len, rate, args.seed + i)
            rows.append(row)
            print_row(row)

    rates = [math.inf if r == "inf" else float(r) for r in args.request_rates]
    try:
        asyncio.run(all_rates())
    finally:
        engine.shutdown()
        ray.shutdown()
    return report(args, model_info, rows, "AsyncLLM in process (--direct: no HTTP, no Ray Serve)")


if __name__ == "__main__":
    main()
