"""The runtime on GPUs, as it stands (torch reference attention, NCCL between stages):
greedy agreement with HF on the GPU (fp32 exact, bf16 as a rate), a sampled workload (seeded
draws equal across PP sizes and within a batch), and throughput against HF `generate` on the
same GPU, PP=1 vs PP=2, async vs sync.

  python bench/gpu_check.py [--requests 64] [--max-tokens 64] [--skip-throughput | --fp32-only]
                           [--sync-debug error]

Every stage runs with RAY_RUNTIME_SYNC_DEBUG=error unless told otherwise: a step whose launch
makes the host wait for the device (a copy from pageable memory, .item(), .tolist()) fails.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import gpu_ray_env, idle_fractions_between, left_padded, save  # noqa: E402


def qwen3_dir(root: str, layers: int, dtype: torch.dtype, small: bool) -> str:
    from transformers import AutoModelForCausalLM, Qwen3Config

    path = os.path.join(root, f"qwen3_{'small' if small else '0.6b'}_{layers}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(0)
    if small:
        cfg = Qwen3Config(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          max_position_embeddings=4096, initializer_range=0.1, tie_word_embeddings=True)
    else:  # Qwen3-0.6B shape
        cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                          num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
                          head_dim=128, max_position_embeddings=4096, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(cfg, dtype=dtype).save_pretrained(path)
    return path


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def agreement(model_dir, dtype_name, pp_sizes, n_req, n_tok, rng, partitions=None):
    """pp_sizes: one engine each; partitions: pp_layer_partition per entry (None: the
    default), or (pp_layer_partition, pp_prefill_partition)."""
    from transformers import AutoModelForCausalLM

    from ray_runtime import LLM, SamplingParams

    dtype = getattr(torch, dtype_name)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    vocab = hf.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 200))] for _ in range(n_req)]
    refs = [hf_greedy(hf, p, n_tok) for p in prompts]
    del hf
    torch.cuda.empty_cache()
    rows = []
    for pp, part in zip(pp_sizes, partitions or [None] * len(pp_sizes)):
        part, prefill = part if isinstance(part, tuple) else (part, None)
        with LLM(model_dir, pipeline_parallel_size=pp, device="cuda", dtype=dtype_name,
                 max_num_batched_tokens=512, num_kv_blocks=2048, pp_layer_partition=part,
                 pp_prefill_partition=prefill) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(max_tokens=n_tok, temperature=0, ignore_eos=True))
            mism = llm.stats()["bookkeeping_mismatches"]
        exact, first_div = 0, []
        for o, ref in zip(outs, refs):
            ours = o.outputs[0].token_ids
            if ours == ref:
                exact += 1
            else:
                first_div.append(next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b))
        rows.append({"dtype": dtype_name, "pp": pp, "partition": part, "prefill_partition": prefill,
                     "requests": n_req, "tokens": n_tok,
                     "exact": exact, "agreement_rate": exact / n_req, "bookkeeping_mismatches": mism,
                     "first_divergence_positions": sorted(first_div)})
        print(f"agreement {dtype_name} PP={pp} partition {part or 'default'} prefill {prefill or 'auto'}: "
              f"{exact}/{n_req} exact; first divergences {sorted(first_div)[:20]}",
              flush=True)
    return rows


SAMPLED_SETTINGS = [dict(), dict(temperature=0.8, top_p=0.9), dict(temperature=0.7, top_k=20),
                    dict(temperature=1.0, min_p=0.05), dict(temperature=0.9, top_k=50, top_p=0.95)]


def sampled(model_dir, pp_sizes, n_req, n_tok, rng, device="cuda"):
    """Sampled requests (the OpenAI default temperature 1.0, top-p, top-k, min-p, some seeded)
    in one batch beside greedy ones, at each PP size, under the stages' sync audit: every
    request gets its n_tok tokens, two requests with the same prompt and seed draw the same
    tokens, and a seeded request draws the same tokens at every PP size (a seed's draws depend
    on the seed and the output index only). Then the same requests with logprobs or penalties
    on some rows (the step reads its samples at once): seeded and greedy rows without
    penalties draw what they drew before, and each logprobs request has an entry per token."""
    from ray_runtime import LLM, SamplingParams

    prompts = [[rng.randrange(3, 2048) for _ in range(rng.randint(16, 200))] for _ in range(n_req)]
    params = []
    for i in range(n_req):
        if i % 6 == 3:  # a twin of request i - 3: its prompt and its seeded params
            prompts[i] = prompts[i - 3]
            params.append(params[i - 3])
            continue
        kw = dict(SAMPLED_SETTINGS[i % len(SAMPLED_SETTINGS)])
        if i % 6 == 0:
            kw["seed"] = 1000 + i
        elif i % 6 == 5:
            kw = dict(temperature=0)
        params.append(SamplingParams(max_tokens=n_tok, ignore_eos=True, **kw))
    # The same batch again with logprobs on some rows and penalties on others: the step then
    # reads its samples on the host at once (the immediate path, not the deferred one).
    import msgspec

    immediate = [msgspec.structs.replace(sp, logprobs=3) if i % 4 == 1 else
                 msgspec.structs.replace(sp, presence_penalty=0.5) if i % 8 == 2 and sp.seed is None
                 else sp for i, sp in enumerate(params)]
    unchanged = [i for i, sp in enumerate(immediate) if not sp.uses_penalties
                 and (sp.seed is not None or sp.is_greedy)]
    rows, seeded_by_pp = [], {}
    for pp in pp_sizes:
        with LLM(model_dir, pipeline_parallel_size=pp, device=device, dtype="float32",
                 max_num_batched_tokens=512, num_kv_blocks=2048) as llm:
            reqs = [{"prompt_token_ids": p} for p in prompts]
            outs = llm.generate(reqs, params)
            outs2 = llm.generate(reqs, immediate)
            mism = llm.stats()["bookkeeping_mismatches"]
        toks = [o.outputs[0].token_ids for o in outs]
        toks2 = [o.outputs[0].token_ids for o in outs2]
        full = sum(len(t) == n_tok for t in toks + toks2)
        twins = [(i - 3, i) for i in range(n_req) if i % 6 == 3]
        twins_equal = sum(toks[a] == toks[b] and toks2[a] == toks2[b] for a, b in twins)
        seeded_by_pp[pp] = {i: toks[i] for i in range(n_req) if params[i].seed is not None}
        with_lp = [o.outputs[0] for o, sp in zip(outs2, immediate) if sp.logprobs is not None]
        logprobs_ok = sum(len(c.logprobs or []) == n_tok and all(
            len(e) >= 1 and t in e and e[t].logprob <= 0 for t, e in zip(c.token_ids, c.logprobs))
            for c in with_lp)
        distinct = len({tuple(t) for t in toks})
        rows.append({"pp": pp, "requests": 2 * n_req, "tokens": n_tok, "full_length": full,
                     "seed_twins": len(twins), "seed_twins_equal": twins_equal,
                     "distinct_outputs": distinct, "bookkeeping_mismatches": mism,
                     "immediate_path_equal": sum(toks[i] == toks2[i] for i in unchanged),
                     "immediate_path_compared": len(unchanged),
                     "logprob_requests_ok": logprobs_ok, "logprob_requests": len(with_lp)})
        print(f"sampled PP={pp}: {rows[-1]}", flush=True)
    base = seeded_by_pp[pp_sizes[0]]
    for row in rows:
        other = seeded_by_pp[row["pp"]]
        row["seeded_equal_to_pp%d" % pp_sizes[0]] = sum(other[i] == base[i] for i in base)
        row["seeded"] = len(base)
    return rows


def seeded_noise_matches_cpu() -> bool:
    """A seed's noise bits on this GPU equal the CPU's (int64 wrap-around on both), and every
    bit pattern gives a positive E on this GPU."""
    from stages.seeded_noise import UNIFORM_BITS, bits_to_exponential, request_key, uniform_bits

    keys = [request_key(s, i) for s in (0, 1, -7, 2 ** 62) for i in (0, 1, 1000)]
    same = torch.equal(uniform_bits(keys, 151936, "cuda").cpu(), uniform_bits(keys, 151936, "cpu"))
    every = torch.arange(2 ** UNIFORM_BITS, dtype=torch.long, device="cuda")
    positive = bool((bits_to_exponential(every) > 0).all())  # every pattern, on this GPU's log
    print(f"seeded noise bits on the GPU equal the CPU's: {same}; every E > 0: {positive}", flush=True)
    return same and positive


def throughput(model_dir, n_req, out_len, rng, pp_sizes):
    from transformers import AutoModelForCausalLM

    from ray_runtime import LLM, SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    vocab = hf.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(100, 300))] for _ in range(n_req)]
    # HF at its best here: batched generate, left padding, one batch of all requests.
    ids, mask = left_padded(prompts)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        hf.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=out_len, min_new_tokens=out_len,
                    do_sample=False, eos_token_id=None, pad_token_id=0)
    torch.cuda.synchronize()
    hf_s = time.perf_counter() - t0
    del hf
    torch.cuda.empty_cache()
    rows = [{"engine": "hf_generate_batched", "pp": 1, "output_tok_s": round(n_req * out_len / hf_s, 1),
             "elapsed_s": round(hf_s, 2)}]
    print(f"HF generate: {rows[-1]['output_tok_s']} tok/s", flush=True)
    sp = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    for pp in pp_sizes:
        if pp > torch.cuda.device_count():
            continue
        for async_scheduling in (False, True):
            with LLM(model_dir, pipeline_parallel_size=pp, device="cuda", dtype="bfloat16",
                     max_num_seqs=n_req, max_num_batched_tokens=4096, num_kv_blocks=8192,
                     async_scheduling=async_scheduling) as llm:
                llm.generate(reqs[:2], SamplingParams(max_tokens=2))
                b = llm.stats()
                t0 = time.perf_counter()
                llm.generate(reqs, sp)
                el = time.perf_counter() - t0
                st = llm.stats()
            steps = st["num_steps"] - b["num_steps"]
            idle = idle_fractions_between(b, st)
            rows.append({"engine": "ray_runtime", "pp": pp, "async": async_scheduling,
                         "output_tok_s": round(n_req * out_len / el, 1), "elapsed_s": round(el, 2),
                         "steps": steps, "ms_per_step": round(1e3 * el / steps, 2), "stage_idle_fraction": idle})
            print(f"ours PP={pp} async={async_scheduling}: {rows[-1]}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--root", default="/tmp/ray_runtime_gpu")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--fp32-only", action="store_true",
                   help="only the float32 greedy agreement (every PP size and split), ~1 minute")
    p.add_argument("--sync-debug", default="error", choices=["error", "warn", "off"],
                   help="RAY_RUNTIME_SYNC_DEBUG for every stage: with error, a step that makes "
                        "its host wait for the device fails the check (stages/profiling.py)")
    args = p.parse_args()
    import ray

    if args.sync_debug != "off":
        os.environ["RAY_RUNTIME_SYNC_DEBUG"] = args.sync_debug
    ray.init(runtime_env={"env_vars": gpu_ray_env()}, include_dashboard=False)
    rng = random.Random(0)
    pps = [n for n in (1, 2, 4) if n <= torch.cuda.device_count()]
    small = qwen3_dir(args.root, 5, torch.float32, small=True)
    result = {"gpus": torch.cuda.device_count(), "sync_debug": args.sync_debug, "agreement": []}
    # the default split at every PP size (at PP=2 the prefill split moves layer 2's MLP);
    # then stage boundaries inside layers, at PP=4 with two MLP blocks moved for prefill
    # (layer_span.py)
    halves = {2: "2.5,2.5", 4: ("2,1,1,1", "1.5,1,1.5,1")}
    parts = [None] * len(pps) + [halves[n] for n in pps if n in halves]
    result["agreement"] += agreement(small, "float32", pps + [n for n in pps if n in halves],
                                     32, 32, rng, parts)
    if args.fp32_only:
        print("wrote", save("gpu_check", result))
        ray.shutdown()
        return
    result["agreement"] += agreement(small, "bfloat16", pps[:1], 200, 32, rng)
    result["sampled"] = sampled(small, pps, 48, 24, rng)
    result["seeded_noise_bits_equal_cpu"] = seeded_noise_matches_cpu()
    if not args.skip_throughput:
        big = qwen3_dir(args.root, args.layers, torch.bfloat16, small=False)
        result["throughput"] = throughput(big, args.requests, args.max_tokens, rng, pps)
        result["throughput_model"] = {"shape": "Qwen3-0.6B", "layers": args.layers, "dtype": "bfloat16",
                                      "weights": "random", "requests": args.requests,
                                      "input_len": [100, 300], "output_len": args.max_tokens}
    print("wrote", save("gpu_check", result))
    ray.shutdown()


if __name__ == "__main__":
    main()
