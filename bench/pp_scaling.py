"""PP scaling on a Llama-3-8B-shaped model (32 layers, hidden 4096, intermediate 14336,
32 heads, 8 KV heads, vocab 128256), random bf16 weights: PP=1 on one GPU vs PP=2 on two,
saturating workloads (one per --output-len, on the same engine). pp{N}_out{L}_scaling_efficiency
= tput(PP=N) / (N x tput(PP=1)), async, with token feedback (and _no_feedback: each token
through the driver, side by side in the same run); async_speedup = tput(async) / tput(sync)
where both modes ran. Per stage: the GPU's idle fraction (1 - its compute spans / wall time)
and the stage loop's.

The ceiling of a fixed workload: PP=N splits the batch of B requests into N micro-batches of
B/N, and each stage reads its weights once per micro-batch, so where a step's time hardly
grows with its rows (memory-bound decode) a bubble-free pipeline gets only
pp{N}_out{L}_fixed_batch_ceiling = tput(PP=1, B/N requests) / tput(PP=1, B requests) of
linear (measured on the PP=1 engine: round time t1(B/N) for B tokens, against N x B / t1(B)).
pp{N}_out{L}_of_ceiling = efficiency / ceiling is how close the pipeline comes to it.

With --matched, PP=N runs N x --requests requests instead (max_num_seqs too, unless
--max-num-seqs is given), so each of its micro-batches is the PP=1 batch:
pp{N}_out{L}_matched_scaling_efficiency = tput(PP=N, N x B) /
(N x tput(PP=1, B)) is the pipeline's own efficiency (bubbles, hops, host), without the
fixed-batch arithmetic. PP=1 then also runs the N x B requests in one batch on its GPU, and
pp{N}_out{L}_pp1_same_total_gain = tput(PP=1, N x B) / tput(PP=1, B) says what a bigger batch
alone buys the one GPU (the matched figure's caveat). async_speedup is reported only for
rows on --requests (PP=1 when matched).

  python bench/pp_scaling.py [--requests 256] [--input-len 256] [--output-len 128 512] [--pp 1 2 4]
                             [--matched] [--max-num-seqs N] [--feedback on off] [--modes async sync] [--partition even 17,15]
                             [--prefill-partition auto same]
                             [--layers 16] [--trace-dir DIR] [--tag h200x2]

With RAY_RUNTIME_PHASE_CLOCK=1 in the environment each row also has
stage_phase_ms_per_step: per rank, the host's wall ms per step in each phase of its loop
(stages/profiling.py; nested phases count inside their parents).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import gpu_ray_env, idle_fractions_between, save  # noqa: E402

SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=128256, head_dim=128)


def random_llama8b(path: str) -> str:
    """Random weights written shard by shard from the GPU (no 8B-parameter init on the CPU)."""
    from safetensors.torch import save_file

    if os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
        return path
    os.makedirs(path, exist_ok=True)
    h, i, v, kv = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"], 8 * 128
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02).cpu()

    weight_map = {}

    def write(name, tensors):
        save_file(tensors, os.path.join(path, name))
        weight_map.update({k: name for k in tensors})

    write("embed.safetensors", {"model.embed_tokens.weight": rnd(v, h), "lm_head.weight": rnd(v, h),
                                "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)})
    for layer in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        write(f"layer{layer}.safetensors", {
            p + "self_attn.q_proj.weight": rnd(h, h), p + "self_attn.k_proj.weight": rnd(kv, h),
            p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, h),
            p + "mlp.gate_proj.weight": rnd(i, h), p + "mlp.up_proj.weight": rnd(i, h),
            p + "mlp.down_proj.weight": rnd(h, i),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
           "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
           "bos_token_id": 128000, "eos_token_id": 128001, **SHAPE}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def first_layers(path: str, layers: int) -> str:
    """The model of path cut to its first `layers` decoder layers: a folder with its own config
    and an index pointing at path's shards (nothing copied). A stage of PP=2 on 16 layers has
    the layers, rows and host work of a stage of PP=4 on 32."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    if layers == cfg["num_hidden_layers"]:
        return path
    out = f"{path}_{layers}layers"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    keep = {k: os.path.join(path, v) for k, v in weight_map.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": keep}, f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({**cfg, "num_hidden_layers": layers}, f)
    return out


def partition_suffix(part: str, prefill: str = "auto") -> str:
    """How a layer partition (and a prefill split) shows in run names and result keys ("" for
    the defaults, 'balanced' and 'auto'; results before 0b85b64 ran the even split as their
    default, before the prefill split every run was 'same')."""
    return ("" if part == "balanced" else "_partition_" + part.replace(",", "_")) + \
        ("" if prefill == "auto" else "_prefill_" + prefill.replace(",", "_"))


def trace_timeline(path: str) -> Optional[dict]:
    """bench/pipeline_timeline.py's figures for a run's trace (its `last_call`: the run's last
    generate call, the longest output length), or None without device spans (the phase
    clock off)."""
    from bench.pipeline_timeline import load_events, timeline

    try:
        return timeline(load_events(path))
    except ValueError:
        return None


def per_step(after: dict, before: dict, key: str) -> list[float]:
    """ms per step of a per-stage seconds counter between two stats() snapshots."""
    return [round(1e3 * (a - z) / max(1, n1 - n0), 3) for a, z, n1, n0 in
            zip(after[key], before[key], after["stage_steps"], before["stage_steps"])]


def phase_ms_per_step(after: dict, before: dict) -> Optional[list]:
    """Per rank, the phase clock's host ms per step of each phase between two stats()
    snapshots (RAY_RUNTIME_PHASE_CLOCK=1, stages/profiling.py), costliest first; None when
    the clock is off."""
    if not any(after.get("stage_phase_s") or []):
        return None
    out = []
    for rank, (a, z) in enumerate(zip(after["stage_phase_s"], before["stage_phase_s"])):
        steps = max(1, after["stage_steps"][rank] - before["stage_steps"][rank])
        z = z or {}
        ms = {k: 1e3 * (v[1] - z.get(k, (0, 0.0))[1]) / steps for k, v in (a or {}).items()}
        out.append({k: round(v, 3) for k, v in sorted(ms.items(), key=lambda kv: -kv[1])
                    if v >= 0.0005})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, nargs="+", default=[128, 512],
                   help="one workload per value, each run on the same engine")
    p.add_argument("--pp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--path", default="/tmp/ray_runtime_gpu/llama3_8b_random")
    p.add_argument("--modes", nargs="+", default=["async"], choices=["async", "sync"])
    p.add_argument("--feedback", nargs="+", default=["on", "off"], choices=["on", "off"],
                   help="PP>1 async: the last rank feeds sampled tokens to rank 0 (on), or "
                        "each token goes through the driver (off), side by side")
    p.add_argument("--tag", default="")
    p.add_argument("--inflight", type=int, nargs="+", default=[0],
                   help="max_inflight_steps values to run at PP>1 (0: the default)")
    p.add_argument("--ceiling-pp", type=int, nargs="+", default=None,
                   help="PP sizes whose micro-batch share the PP=1 engine also runs, for the "
                        "fixed-batch ceiling (default: the --pp sizes); e.g. 4 on a 2-GPU machine")
    p.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"],
                   help="run the model's first N layers (16 at PP=2: the stage of PP=4 on 32)")
    p.add_argument("--trace-dir", default=None, help="write a pipeline trace per run there")
    p.add_argument("--partition", nargs="+", default=["balanced"],
                   help="PP>1 layer partitions to run side by side: 'balanced' (the default "
                        "split), 'even', or layers per stage, e.g. 17,15")
    p.add_argument("--prefill-partition", nargs="+", default=["auto"],
                   help="pp_prefill_partition per run: auto (the default), same (decode's) or "
                        "layers per stage")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="the engine's max_num_seqs (default: every request held at once); "
                        "below --requests the rest wait in the queue")
    p.add_argument("--matched", action="store_true",
                   help="PP=N runs N x --requests (each micro-batch the PP=1 batch); PP=1 runs "
                        "those totals too")
    args = p.parse_args()
    import ray

    from ray_runtime import LLM, SamplingParams

    t0 = time.perf_counter()
    model = first_layers(random_llama8b(args.path), args.layers)
    print(f"checkpoint ready in {time.perf_counter() - t0:.0f}s", flush=True)
    ray.init(runtime_env={"env_vars": gpu_ray_env()}, include_dashboard=False)
    rng = random.Random(0)
    scale = max(args.pp) if args.matched else 1
    reqs = [{"prompt_token_ids": [rng.randrange(3, 128000) for _ in range(args.input_len)]}
            for _ in range(args.requests * scale)]
    rows = []
    timelines: dict = {}
    runs = [(pp, m, fb, n, part, pf) for pp in args.pp for m in args.modes
            for fb in (args.feedback if pp > 1 and m == "async" else ["on"])
            for n in (args.inflight if pp > 1 and m == "async" else [0])
            for part in (args.partition if pp > 1 else ["balanced"])
            for pf in (args.prefill_partition if pp > 1 else ["auto"])]
    longest = max(args.output_len)
    for pp, mode, fb, inflight, part, pf in runs:
        # PP=N's requests: N x B when matched (PP=1 holds the largest total for its extra rows)
        held = args.requests * ((scale if pp == 1 else pp) if args.matched else 1)
        blocks = held * ((args.input_len + longest) // 16 + 2)
        name = f"pp{pp}_{mode}" + (f"_feedback_{fb}" if pp > 1 and mode == "async" else "") \
            + partition_suffix(part, pf)
        with LLM(model, pipeline_parallel_size=pp, device="cuda", dtype="bfloat16",
                 max_num_seqs=args.max_num_seqs or held, max_num_batched_tokens=8192, num_kv_blocks=blocks,
                 max_model_len=args.input_len + longest + 16,
                 async_scheduling=mode == "async", max_inflight_steps=inflight or None,
                 pp_token_feedback=fb == "on",
                 pp_layer_partition=part, pp_prefill_partition=pf,
                 trace_file=os.path.join(args.trace_dir, f"trace_{name}.json")
                 if args.trace_dir else None) as llm:
            # Warm-up: every prefill and decode shape of the workload (kernels compiled and
            # tuned, graphs replayed once) before anything is timed.
            llm.generate(reqs[:held], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
            # PP=1 also runs each micro-batch's share of the requests alone: the ceiling
            # (matched: the PP=N totals in one batch instead).
            extra = [args.requests * n for n in args.pp if n > 1] if args.matched else \
                [args.requests // n for n in (args.ceiling_pp or args.pp) if n > 1]
            shares = [held if pp > 1 else args.requests] + \
                (extra if pp == 1 and mode == "async" else [])
            for out_len, num in [(L, n) for L in args.output_len for n in shares]:
                sp = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
                b = llm.stats()
                t0, epoch0 = time.perf_counter(), time.time()
                llm.generate(reqs[:num], sp)
                el = time.perf_counter() - t0
                epochs = (epoch0, epoch0 + el)
                st = llm.stats()
                gpu_busy = [a - z for a, z in zip(st["stage_gpu_busy_s"], b["stage_gpu_busy_s"])]
                rows.append({
                    "pp": pp, "async": mode == "async", "feedback": fb == "on" and pp > 1
                    and mode == "async", "output_len": out_len, "requests": num,
                    "max_inflight_steps": inflight or llm.config.inflight_steps,
                    "partition": part, "prefill_partition": pf,
                    "elapsed_s": round(el, 2),
                    "output_tok_s": round(num * out_len / el, 1),
                    "steps": st["num_steps"] - b["num_steps"],
                    # the device's view: 1 - (compute spans of the stage's steps) / wall time
                    "stage_gpu_idle_fraction": [round(1 - g / el, 3) for g in gpu_busy],
                    # the stage loop's view: time between steps and waiting for activations
                    "stage_idle_fraction": idle_fractions_between(b, st),
                    # the host's launch of a step against the device's time for it
                    "stage_launch_ms_per_step": per_step(st, b, "stage_launch_s"),
                    "stage_gpu_ms_per_step": per_step(st, b, "stage_gpu_busy_s"),
                    "driver_s": {k: round(st[f"driver_{k}_s"] - b[f"driver_{k}_s"], 3)
                                 for k in ("plan", "wait", "audit", "gc")}})
                phases = phase_ms_per_step(st, b)
                if phases is not None:
                    rows[-1]["stage_phase_ms_per_step"] = phases
                print(rows[-1], flush=True)
        if args.trace_dir:  # written as the engine shut down: where the last call's time went
            timelines[name] = trace_timeline(os.path.join(args.trace_dir, f"trace_{name}.json"))
            call = (timelines[name] or {}).get("last_call")
            if call:  # the call's wall time outside the devices' window (rank 0's first
                # start to the last stage's last end): adding requests, the last outputs
                rows[-1]["outside_devices_s"] = round(rows[-1]["elapsed_s"] - call["wall_ms"] / 1e3, 3)
                w0, w1 = call["window_epoch_ms"]  # split: before the first step, after the last
                rows[-1]["before_devices_s"] = round(w0 / 1e3 - epochs[0], 3)
                rows[-1]["after_devices_s"] = round(epochs[1] - w1 / 1e3, 3)
    result = {"model": {"shape": "Llama-3-8B", **SHAPE, "num_hidden_layers": args.layers, "dtype": "bfloat16", "weights": "random"},
              "workload": {"requests": args.requests, "matched": args.matched,
                           "max_num_seqs": args.max_num_seqs, "input_len": args.input_len,
                           "output_len": args.output_len, "ignore_eos": True}, "rows": rows}
    if timelines:
        result["pipeline_timeline"] = timelines
    pp1 = {(r["output_len"], r["requests"]): r["output_tok_s"] for r in rows
           if r["pp"] == 1 and r["async"]}
    if not pp1 and any(r["pp"] > 1 for r in rows):
        print("no async PP=1 rows (--pp without 1, or --modes sync only): no scaling figures")
    for r in rows:
        base = pp1.get((r["output_len"], args.requests))
        if not (r["pp"] > 1 and r["async"] and base):
            continue
        key = f"pp{r['pp']}_out{r['output_len']}" + ("" if r["feedback"] else "_no_feedback") \
            + (f"_inflight{r['max_inflight_steps']}" if args.inflight != [0] else "") \
            + partition_suffix(r["partition"], r["prefill_partition"])
        eff = r["output_tok_s"] / (r["pp"] * base)
        if args.matched:
            result[key + "_matched_scaling_efficiency"] = round(eff, 3)
            same = pp1.get((r["output_len"], r["requests"]))
            if same:
                result[f"pp{r['pp']}_out{r['output_len']}_pp1_same_total_gain"] = round(same / base, 3)
            continue
        result[key + "_scaling_efficiency"] = round(eff, 3)
        share = pp1.get((r["output_len"], args.requests // r["pp"]))
        if share:
            ceiling = share / base
            result[f"pp{r['pp']}_out{r['output_len']}_fixed_batch_ceiling"] = round(ceiling, 3)
            result[key + "_of_ceiling"] = round(eff / ceiling, 3)
    for n in args.ceiling_pp or []:  # PP sizes that were not run here: their ceiling alone
        for out_len in args.output_len:
            base, share = pp1.get((out_len, args.requests)), pp1.get((out_len, args.requests // n))
            if n > 1 and base and share:
                result[f"pp{n}_out{out_len}_fixed_batch_ceiling"] = round(share / base, 3)
    sync = {(r["pp"], r["output_len"], r["partition"], r["prefill_partition"]): r["output_tok_s"] for r in rows
            if not r["async"] and r["requests"] == args.requests}
    for r in rows:
        key = (r["pp"], r["output_len"], r["partition"], r["prefill_partition"])
        if r["async"] and r["feedback"] == (r["pp"] > 1) and r["requests"] == args.requests \
                and key in sync:
            part = partition_suffix(r["partition"], r["prefill_partition"])
            result[f"async_speedup_pp{r['pp']}_out{r['output_len']}{part}"] = round(
                r["output_tok_s"] / sync[key], 3)
    print({k: v for k, v in result.items() if "efficiency" in k or "speedup" in k or "ceiling" in k or "gain" in k})
    ray.shutdown()
    print("wrote", save("pp_scaling" + (f"_{args.tag}" if args.tag else ""), result))


if __name__ == "__main__":
    main()
