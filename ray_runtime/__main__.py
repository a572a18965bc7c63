"""The CLI, and the entrypoint that `ray job submit` runs.

  python -m ray_runtime generate --model DIR --pipeline-parallel-size 2 \
      --input prompts.jsonl --output out.jsonl [--max-tokens N --temperature T ...]
  python -m ray_runtime demo [--pipeline-parallel-size 2]
  python -m ray_runtime serve --model DIR --pipeline-parallel-size 2 [--host H --port 8000]

Input lines are {"prompt": "..."} or {"prompt_token_ids": [...]}, optionally with
"sampling_params": {...} overriding the flags for that line, and "messages": [...] (chat)
in place of a prompt. Output lines keep the input order.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

from ray_runtime.cli_args import add_engine_args, engine_kwargs
from ray_runtime.sampling_params import SamplingParams


def _engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (ray_runtime/cli_args.py), defaults from EngineConfig."""
    add_engine_args(p)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None)


def build_llm(args):
    from ray_runtime.api import LLM

    model = args.model
    if model is None:
        from ray_runtime.demo_model import ensure_smollm2

        model = ensure_smollm2()
    llm = LLM(model=model, tokenizer=args.tokenizer, **engine_kwargs(args))
    _install_signal_handlers()
    return llm


def default_sampling(args) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                          ignore_eos=args.ignore_eos, logprobs=args.logprobs)


def read_requests(path: str, defaults: SamplingParams) -> list[tuple[str, object, SamplingParams]]:
    """Every row of the input file, checked before any engine starts: (kind, prompt, params)
    with kind "messages" (rendered with the chat template once the tokenizer is loaded),
    "prompt_token_ids" or "prompt"."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: a row must be a JSON object")
            kind = next((k for k in ("messages", "prompt_token_ids", "prompt") if k in row), None)
            if kind is None:
                raise ValueError(f"{path}:{n}: needs 'prompt', 'prompt_token_ids' or 'messages'")
            overrides = row.get("sampling_params") or {}
            try:
                params = SamplingParams(**{**_as_dict(defaults), **overrides})
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}:{n}: sampling_params: {e}") from None
            rows.append((kind, row[kind], params))
    return rows


def render_prompts(rows, llm) -> tuple[list, list[SamplingParams]]:
    prompts = [llm.render_chat(v) if kind == "messages" else
               {"prompt_token_ids": v} if kind == "prompt_token_ids" else v for kind, v, _ in rows]
    return prompts, [p for _, _, p in rows]


def _as_dict(sp: SamplingParams) -> dict:
    return {f: getattr(sp, f) for f in sp.__struct_fields__}


def cmd_generate(args) -> int:
    rows = read_requests(args.input, default_sampling(args))  # bad input: exit 2, no engine
    with build_llm(args) as llm:
        prompts, params = render_prompts(rows, llm)
        print(f"generating {len(prompts)} requests", flush=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        # Written whole to a temporary file, then renamed into place: an interrupted run
        # never leaves a partial file under the output's name.
        tmp = f"{args.output}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            for i, out in enumerate(outs):
                c = out.outputs[0]
                f.write(json.dumps({"index": i, "request_id": out.request_id, "prompt": out.prompt,
                                    "text": c.text, "token_ids": c.token_ids,
                                    "finish_reason": c.finish_reason,
                                    "num_prompt_tokens": len(out.prompt_token_ids)}) + "\n")
        os.replace(tmp, args.output)
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"{len(outs)} requests, {n_out} output tokens in {elapsed:.2f}s "
              f"({n_out / elapsed:.1f} tok/s); stats: {json.dumps(llm.stats())}")
    return 0


DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Explain in two sentences what a pipeline-parallel language model runtime does.",
    "Write a haiku about distributed computing.",
]


def cmd_demo(args) -> int:
    with build_llm(args) as llm:
        prompts = [llm.render_chat([{"role": "user", "content": q}]) for q in DEMO_QUESTIONS]
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        elapsed = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        for q, out in zip(DEMO_QUESTIONS, outs):
            print(f"\n### {q}\n{out.outputs[0].text.strip()}")
        cfg = llm.config
        print(f"\nPP={cfg.pipeline_parallel_size} on {cfg.device}: {len(outs)} requests, "
              f"{n_out} output tokens in {elapsed:.2f}s = {n_out / elapsed:.1f} tok/s")
        stats = llm.stats()
        if args.result_json:
            _save_demo_result(args, cfg, len(outs), n_out, elapsed, stats)
        print(f"steps {stats['num_steps']}, stage idle fraction "
              f"{[round(f, 3) for f in stats['stage_idle_fraction']]}, bookkeeping mismatches "
              f"{stats['bookkeeping_mismatches']}")
    return 0


def _save_demo_result(args, cfg, n_req: int, n_out: int, elapsed: float, stats: dict) -> None:
    import datetime
    import os
    import platform

    record = {"bench": "demo", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": "python -m ray_runtime " + " ".join(sys.argv[1:]),
              "device": f"{cfg.device}: {platform.machine()} x{os.cpu_count()}",
              "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized, run in " + cfg.dtype + ")",
              "pipeline_parallel_size": cfg.pipeline_parallel_size, "requests": n_req,
              "output_tokens": n_out, "elapsed_s": round(elapsed, 3),
              "output_tok_s": round(n_out / elapsed, 2), "steps": stats["num_steps"],
              "stage_idle_fraction": stats["stage_idle_fraction"]}
    with open(args.result_json, "w") as f:
        json.dump(record, f, indent=1)


def cmd_serve(args) -> int:
    """The OpenAI-compatible server (ray_runtime/server/app.py) on Ray Serve: join the
    cluster at RAY_ADDRESS or start a local one, deploy, print the URL, block until SIGINT
    or SIGTERM, then delete the app (and shut down Serve and Ray if it started them)."""
    import ray
    from ray import serve

    from ray_runtime.server.app import build_app

    model = args.model
    if model is None:
        from ray_runtime.demo_model import ensure_smollm2

        model = ensure_smollm2()
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"--model {model!r}: not a checkpoint folder (no config.json)")
    application = build_app({  # bad arguments raise here, before Ray starts
        "model": model, "tokenizer": args.tokenizer, **engine_kwargs(args),
        "served_model_name": args.served_model_name,
        "max_ongoing_requests": args.max_ongoing_requests})
    address = getattr(args, "address", None) or os.environ.get("RAY_ADDRESS")
    started_ray = not address
    if started_ray:  # a local cluster, whose workers import this package from here
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        ray.init(address="local", runtime_env={"env_vars": {"PYTHONPATH": path}})
    else:  # join it (a `ray job submit` sets RAY_ADDRESS); leave it running after
        ray.init(address=address)
    _install_signal_handlers()
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(application, name=args.app_name, route_prefix="/")
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        print(f"serving {args.served_model_name or model} at http://{host}:{args.port}/v1 "
              "(Ctrl-C or SIGTERM stops it)", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        signum = _signal_received[0] if _signal_received else signal.SIGINT
        print(f"{signal.Signals(signum).name}: shutting the server down", file=sys.stderr)
    finally:
        serve.delete(args.app_name)  # its replica shuts its engine down
        if started_ray or not serve.status().applications:
            serve.shutdown()  # no other application uses this Serve instance
        if started_ray:
            ray.shutdown()
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ray_runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline batch generation: jsonl in, jsonl out")
    _engine_args(gen)
    _sampling_args(gen)
    gen.add_argument("--input", required=True)
    gen.add_argument("--output", required=True)
    demo = sub.add_parser("demo", help="chat answers from SmolLM2-135M-Instruct, with tok/s")
    _engine_args(demo)
    demo.set_defaults(pipeline_parallel_size=2)  # the demo shows the pipeline
    demo.add_argument("--max-tokens", type=int, default=96)
    demo.add_argument("--result-json", default=None, help="also write the figures here")
    srv = sub.add_parser("serve", help="an OpenAI-compatible server on Ray Serve")
    _engine_args(srv)
    srv.add_argument("--host", default="0.0.0.0")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None, help="the API's model name (default: --model)")
    srv.add_argument("--max-ongoing-requests", type=int, default=256,
                     help="requests one replica takes at once (Ray Serve's max_ongoing_requests)")
    srv.add_argument("--app-name", default="ray_pp", help="the Serve application's name")
    args = parser.parse_args(argv)
    # Our INFO lines (which cluster was joined, where the stages run) reach the terminal and
    # the job logs; other libraries stay at WARNING.
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("ray_runtime").setLevel(logging.INFO)
    _install_signal_handlers()
    try:
        return {"generate": cmd_generate, "demo": cmd_demo, "serve": cmd_serve}[args.command](args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        signum = _signal_received[0] if _signal_received else signal.SIGINT
        print(f"interrupted by {signal.Signals(signum).name}: stopped, no output written",
              file=sys.stderr)
        return 128 + signum


_signal_received: list[int] = []


def _install_signal_handlers() -> None:
    """Again after connecting to Ray, whose core worker installs its own SIGTERM handler."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupted)


def _interrupted(signum, frame) -> None:
    """SIGINT or SIGTERM: raised as KeyboardInterrupt (what a blocked ray.get passes on);
    LLM.__exit__ then kills the engine at once instead of draining it."""
    _signal_received.append(signum)
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
