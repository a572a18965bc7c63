"""Speculative decoding speedups (issue 5, "Measure"): ngram and draft-model decoding against
plain decoding at several concurrencies, on a copy-heavy workload (each prompt is one random
span repeated, so outputs that continue the repetition can be drafted by n-gram lookup) and on
random prompts; acceptance rates; async vs sync; PP=1 and PP=2.

  python bench/spec_decode.py [--device cuda] [--pp 1,2] [--concurrency 1,8,64] [--k 4]
      [--methods plain,ngram,draft_model] [--modes async,sync] [--workloads copy,random]
      [--out-len 128] [--prompt-len 256] [--draft-layers 2] [--tag gpu]
  python bench/spec_decode.py --smoke          # CPU, tiny everything

Weights are random (untrained), so acceptance rates are whatever the random model gives. The
draft is a layer-truncated self-draft: the target's checkpoint with embeddings, final norm and
lm_head but only its first --draft-layers decoder layers (same vocabulary by construction).
One engine per (pp, mode, method), warmed up once (largest batch, 24 tokens), reused for every workload and concurrency;
concurrency c = one generate() call with c prompts. speedup = tok/s(method) / tok/s(plain) at
the same (workload, pp, mode, concurrency).
"""
from __future__ import annotations

import argparse
import json
import operator
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import gpu_ray_env, save, tiny_llama  # noqa: E402

SPEC_KEYS = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens",
             "num_steps", "num_generated_tokens")


def truncated_draft(target: str, root: str, n: int) -> str:
    """<root>/<target>-draft-N: the target's tensors minus decoder layers >= n, num_hidden_layers=n."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(root, f"{os.path.basename(target.rstrip('/'))}-draft-{n}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    index, files = os.path.join(target, "model.safetensors.index.json"), ["model.safetensors"]
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    keep = {}
    for f in files:
        for name, t in load_file(os.path.join(target, f)).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= n:
                continue
            keep[name] = t.contiguous()
    with open(os.path.join(target, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = n
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][:n]
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = min(cfg["max_window_layers"], n)
    os.makedirs(path, exist_ok=True)
    save_file(keep, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return path


def make_prompts(workload: str, n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if workload == "copy":  # a random span of length/4 repeated to the prompt length
            span = [rng.randrange(3, vocab) for _ in range(max(4, length // 4))]
            out.append((span * (length // len(span) + 1))[:length])
        else:
            out.append([rng.randrange(3, vocab) for _ in range(length)])
    return out


def spec_delta(before: dict, after: dict) -> dict:
    d = {k: after[k] - before[k] for k in SPEC_KEYS}
    d["spec_num_accepted_tokens_per_pos"] = [a - b for a, b in zip(
        after["spec_num_accepted_tokens_per_pos"], before["spec_num_accepted_tokens_per_pos"])]
    d["acceptance_rate"] = round(d["spec_num_accepted_tokens"] / d["spec_num_draft_tokens"], 4) \
        if d["spec_num_draft_tokens"] else None
    d["mean_accepted_per_draft"] = round(d["spec_num_accepted_tokens"] / d["spec_num_drafts"], 3) \
        if d["spec_num_drafts"] else None
    d["tokens_per_step"] = round(d["num_generated_tokens"] / d["num_steps"], 3) if d["num_steps"] else None
    return d


def fmt(v, width: int) -> str:
    return f"{v:>{width}.3f}" if v is not None else f"{'-':>{width}}"


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--target-layers", type=int, default=None, help="default 28 on cuda, 4 on cpu")
    p.add_argument("--draft-layers", type=int, default=None, help="default 2 on cuda, 1 on cpu")
    p.add_argument("--draft", default=None, help="a draft checkpoint instead of the truncated self-draft")
    p.add_argument("--pp", default=None, help='default "1,2" on cuda, "1" on cpu')
    p.add_argument("--concurrency", default="1,8,64")
    p.add_argument("--methods", default="plain,ngram,draft_model")
    p.add_argument("--modes", default="async,sync")
    p.add_argument("--workloads", default="copy,random")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--out-len", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: 2x what the largest batch needs")
    p.add_argument("--root", default=None)
    p.add_argument("--tag", default=None, help='default "gpu" on cuda, "cpu_smoke" on cpu')
    p.add_argument("--smoke", action="store_true", help="CPU, concurrency 1,4, out-len 16, prompt-len 48")
    args = p.parse_args()
    cuda = args.device == "cuda"
    if args.smoke:
        args.concurrency, args.out_len, args.prompt_len = "1,4", 16, 48
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    layers = args.target_layers or (28 if cuda else 4)
    draft_layers = args.draft_layers or (2 if cuda else 1)
    pps, concs = ints(args.pp or ("1,2" if cuda else "1")), ints(args.concurrency)
    methods, modes, workloads = (s.split(",") for s in (args.methods, args.modes, args.workloads))
    root = args.root or ("/tmp/ray_runtime_gpu" if cuda else "/tmp/ray_runtime_bench")
    tag = args.tag or ("gpu" if cuda else "cpu_smoke")

    import ray
    import torch

    from ray_runtime import LLM, SamplingParams

    if cuda:
        from bench.gpu_check import qwen3_dir

        target = qwen3_dir(root, layers, getattr(torch, dtype), small=False)
        shape = {"shape": "Qwen3-0.6B", "family": "qwen3"}
    else:
        target = tiny_llama(os.path.join(root, f"llama_spec_256x{layers}"), hidden=256, layers=layers,
                            heads=4, kv_heads=2, intermediate=768, vocab=2048)
        shape = {"shape": "tiny llama", "family": "llama"}
    with open(os.path.join(target, "config.json")) as f:
        tcfg = json.load(f)
    vocab = tcfg["vocab_size"]
    shape.update(hidden=tcfg["hidden_size"], layers=layers, vocab=vocab, dtype=dtype, weights="random")
    draft = args.draft or (truncated_draft(target, root, draft_layers) if "draft_model" in methods else None)

    max_c, max_len = max(concs), args.prompt_len + args.out_len + args.k + 16
    blocks = args.num_kv_blocks or 2 * max_c * (max_len // 16 + 2)
    prompts = {(w, c): make_prompts(w, c, args.prompt_len, vocab, seed=1000 * i + c)
               for i, w in enumerate(workloads) for c in concs}
    sp = SamplingParams(max_tokens=args.out_len, temperature=0, ignore_eos=True)
    if cuda:
        ray.init(runtime_env={"env_vars": gpu_ray_env()}, include_dashboard=False)
    else:
        ray.init(num_cpus=max(8, max(pps)), include_dashboard=False, log_to_driver=False)

    rows, errors, plain_outs = [], [], {}  # plain_outs: greedy outputs, to check spec rows against
    engine_kw = {"device": args.device, "dtype": dtype, "max_num_seqs": max(64, max_c), "num_kv_blocks": blocks,
                 "max_num_batched_tokens": 8192 if cuda else 1024, "max_model_len": max_len}
    print(f"{'workload':8} {'pp':>2} {'mode':5} {'method':11} {'conc':>4} {'tok/s':>9} {'speedup':>7} "
          f"{'accept':>6} {'acc/draft':>9} {'tok/step':>8} {'same':>5}", flush=True)
    for pp, method, mode in ((pp, method, mode) for pp in pps for method in methods for mode in modes):
        spec = None if method == "plain" else (
            {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1,
             "prompt_lookup_max": 4} if method == "ngram" else
            {"method": "draft_model", "model": draft, "num_speculative_tokens": args.k})
        try:  # one failing configuration is recorded, the others still run
            with LLM(target, pipeline_parallel_size=pp, async_scheduling=mode == "async",
                     speculative_config=spec, **engine_kw) as llm:
                # Warm-up at the largest batch, long enough that every kernel variant (each
                # draft count, each batch shape) is compiled before anything is timed.
                llm.generate([{"prompt_token_ids": q} for q in prompts[(workloads[0], max(concs))]],
                             SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
                for w, c in ((w, c) for w in workloads for c in concs):
                    before = llm.stats()
                    t0 = time.perf_counter()
                    outs = llm.generate([{"prompt_token_ids": q} for q in prompts[(w, c)]], sp)
                    el = time.perf_counter() - t0
                    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
                    r = {"workload": w, "pp": pp, "mode": mode, "method": method, "concurrency": c,
                         "elapsed_s": round(el, 4), "output_tokens": n_out,
                         "output_tok_s": round(n_out / el, 1), **spec_delta(before, llm.stats())}
                    toks = [o.outputs[0].token_ids for o in outs]
                    ref = plain_outs.setdefault((w, pp, c), toks) if method == "plain" else plain_outs.get((w, pp, c))
                    r["same_as_plain"] = None if ref is None else round(sum(map(operator.eq, toks, ref)) / c, 3)
                    rows.append(r)
                    base = next((b for b in rows if b["method"] == "plain" and
                                 (b["workload"], b["pp"], b["mode"], b["concurrency"]) == (w, pp, mode, c)), None)
                    r["speedup_vs_plain"] = round(r["output_tok_s"] / base["output_tok_s"], 3) if base else None
                    print(f"{w:8} {pp:>2} {mode:5} {method:11} {c:>4} {r['output_tok_s']:>9.1f} "
                          f"{fmt(r['speedup_vs_plain'], 7)} {fmt(r['acceptance_rate'], 6)} "
                          f"{fmt(r['mean_accepted_per_draft'], 9)} {fmt(r['tokens_per_step'], 8)} {fmt(r['same_as_plain'], 5)}", flush=True)
        except Exception as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
            errors.append({"pp": pp, "mode": mode, "method": method, "error": msg})
            print(f"{'-':8} {pp:>2} {mode:5} {method:11} FAILED {msg}", flush=True)
    ray.shutdown()
    path = save(f"spec_decode_{tag}", {
        "model": {"target": shape,
                  "draft": None if draft is None else {
                      "kind": "given checkpoint" if args.draft else "layer-truncated self-draft",
                      "path": draft, "layers": draft_layers if not args.draft else None,
                      "note": "first N decoder layers of the target + its embeddings, final norm, lm_head; "
                              "random weights, untrained"}},
        "weights": "random (untrained): acceptance rates reflect the random model, not a real one",
        "workload": {"copy": "random span of prompt_len/4 tokens repeated to prompt_len (random weights do not "
                             "copy it: greedy outputs fall into short loops of their own, which ngram then drafts)",
                     "random": "uniform random token ids", "prompt_len": args.prompt_len,
                     "out_len": args.out_len, "greedy": True, "ignore_eos": True, "concurrency": concs,
                     "workloads": workloads},
        "engine": {"k": args.k, "ngram": {"prompt_lookup_min": 1, "prompt_lookup_max": 4},
                   "num_kv_blocks": blocks, "max_model_len": max_len, "pp": pps, "modes": modes,
                   "max_num_batched_tokens": 8192 if cuda else 1024},
        "columns": {"acceptance_rate": "accepted / drafted tokens", "mean_accepted_per_draft":
                    "accepted tokens per (request, step) that carried drafts", "tokens_per_step":
                    "generated tokens / engine steps", "same_as_plain": "fraction of requests whose greedy "
                    "output equals plain decoding's (same workload, pp, concurrency)"},
        "rows": rows, "failed_configs": errors})
    print("wrote", path)


if __name__ == "__main__":
    main()
