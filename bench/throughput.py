"""The nano-vllm throughput recipe: 256 requests, input and output lengths uniform in
[100, 1024] (seeded), ignore_eos, random bf16 weights of a Qwen3-0.6B shape; ours at PP=1
on one GPU against HF transformers `generate` on the same GPU, same prompts, same run.

  python bench/throughput.py [--requests 256] [--min-len 100] [--max-len 1024] [--hf-batch 256]

HF gets one batched, left-padded `generate` per group of --hf-batch requests, with
max_new_tokens set to the group's longest output (its tokens past each request's own output
length are not counted).

roofline_tok_s: the output tok/s the workload's bytes allow at the copy bandwidth measured in
the same run (bench/common.py's decode_step_bytes: weights once per step plus each running
request's KV, all requests starting together); recipe_roofline_fraction = ours / that.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import decode_step_bytes, left_padded, mem_bandwidth, model_bytes, save  # noqa: E402
from bench.gpu_check import qwen3_dir  # noqa: E402


def run_hf(model_dir, prompts, out_lens, batch):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in range(0, len(prompts), batch):
        group, outs = prompts[s:s + batch], out_lens[s:s + batch]
        ids, mask = left_padded(group)
        with torch.no_grad():
            hf.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=max(outs),
                        min_new_tokens=max(outs), do_sample=False, eos_token_id=None, pad_token_id=0)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    del hf
    torch.cuda.empty_cache()
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--hf-batch", type=int, default=256)
    p.add_argument("--num-kv-blocks", type=int, default=40000)
    p.add_argument("--root", default="/tmp/ray_runtime_gpu")
    p.add_argument("--compare-eager", action="store_true", help="also run ours without CUDA graphs")
    args = p.parse_args()
    import ray

    from ray_runtime import LLM, SamplingParams

    rng = random.Random(0)
    model = qwen3_dir(args.root, 28, torch.bfloat16, small=False)
    prompts = [[rng.randrange(3, 151936) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.requests)]
    out_lens = [rng.randint(args.min_len, args.max_len) for _ in range(args.requests)]
    n_in, n_out = sum(map(len, prompts)), sum(out_lens)
    bw = mem_bandwidth("cuda")  # before the engine takes the GPU's memory
    weight_bytes, kv_per_token = model_bytes(model, dtype_bytes=2)  # bf16
    roofline_s = sum(decode_step_bytes(weight_bytes, kv_per_token, list(map(len, prompts)),
                                       out_lens)) / bw
    roofline_tok_s = n_out / roofline_s
    ray.init(include_dashboard=False)

    def ours(enforce_eager: bool) -> float:
        with LLM(model, device="cuda", dtype="bfloat16", max_num_seqs=args.requests,
                 max_num_batched_tokens=8192, num_kv_blocks=args.num_kv_blocks,
                 max_model_len=2 * args.max_len + 16, enforce_eager=enforce_eager) as llm:
            llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4))
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": q} for q in prompts],
                         [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in out_lens])
            took = time.perf_counter() - t0
            stats = llm.stats()
        print(f"ours{' (eager)' if enforce_eager else ''}: {n_out / took:.0f} output tok/s, "
              f"{(n_in + n_out) / took:.0f} total tok/s ({took:.1f}s, {stats['num_steps']} steps)",
              flush=True)
        return took

    ours_s = ours(enforce_eager=False)  # CUDA graphs for decode steps (the default)
    print(f"roofline: {roofline_tok_s:.0f} output tok/s at {bw / 1e9:.0f} GB/s copy bandwidth; "
          f"ours = {n_out / ours_s / roofline_tok_s:.3f} of it", flush=True)
    eager_s = ours(enforce_eager=True) if args.compare_eager else None
    hf_s = run_hf(model, prompts, out_lens, args.hf_batch)
    print(f"HF:   {n_out / hf_s:.0f} output tok/s ({hf_s:.1f}s)", flush=True)
    ray.shutdown()
    print("wrote", save("throughput", {
        "model": {"shape": "Qwen3-0.6B", "layers": 28, "dtype": "bfloat16", "weights": "random"},
        "workload": {"requests": args.requests, "input_len": [args.min_len, args.max_len],
                     "output_len": [args.min_len, args.max_len], "seed": 0, "ignore_eos": True,
                     "input_tokens": n_in, "output_tokens": n_out},
        "ours": {"pp": 1, "async": True, "elapsed_s": round(ours_s, 2),
                 "output_tok_s": round(n_out / ours_s, 1), "total_tok_s": round((n_in + n_out) / ours_s, 1)},
        "hf": {"method": f"batched generate, {args.hf_batch} per batch, left padding",
               "elapsed_s": round(hf_s, 2), "output_tok_s": round(n_out / hf_s, 1)},
        "speedup_vs_hf": round(hf_s / ours_s, 2),
        "hbm_copy_bandwidth_GBps": round(bw / 1e9, 1), "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_per_token, "roofline_s": round(roofline_s, 3),
        "roofline_tok_s": round(roofline_tok_s, 1),
        "recipe_roofline_fraction": round(n_out / ours_s / roofline_tok_s, 4),
        "ours_eager": None if eager_s is None else {
            "elapsed_s": round(eager_s, 2), "output_tok_s": round(n_out / eager_s, 1),
            "cuda_graph_speedup": round(eager_s / ours_s, 3)}}))


if __name__ == "__main__":
    main()
