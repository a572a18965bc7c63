"""Shared bench plumbing: results as JSON in bench/results/, with the command that made them."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def git_commit() -> str:
    """HEAD, or $BENCH_GIT_COMMIT where the checkout's .git is not the code's (the lent GPU
    machines get the working tree with a stale .git: pass the commit there)."""
    if os.environ.get("BENCH_GIT_COMMIT"):
        return os.environ["BENCH_GIT_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                       text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return f"cpu: {platform.processor() or platform.machine()} x{os.cpu_count()}"


def save(name: str, payload: dict) -> str:
    out_dir = os.environ.get("BENCH_OUT") or os.path.join(HERE, "results")
    os.makedirs(out_dir, exist_ok=True)
    record = {"bench": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "git_commit": git_commit(), "device": device_name(),
              "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
              **payload}
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return path


def tiny_llama(path: str, *, hidden: int, layers: int, heads: int, kv_heads: int,
               intermediate: int, vocab: int, max_pos: int = 4096) -> str:
    """Random weights of a given Llama shape, saved once."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=intermediate,
                      vocab_size=vocab, max_position_embeddings=max_pos, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def idle_fractions_between(before: dict, after: dict) -> list[float]:
    """Per-stage idle / (busy + idle) over the window between two stats() snapshots."""
    out = []
    for b1, b0, i1, i0 in zip(after["stage_busy_s"], before["stage_busy_s"],
                              after["stage_idle_s"], before["stage_idle_s"]):
        busy, idle = b1 - b0, i1 - i0
        out.append(round(idle / (busy + idle), 3) if busy + idle else 0.0)
    return out


def left_padded(prompts: list[list[int]]):
    """(input_ids, attention_mask) for HF batched generate, padded on the left with 0."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def gpu_ray_env() -> dict:
    """The variables every Ray worker needs on the multi-GPU machines (NVLink multicast off),
    every NCCL_* setting, and the stage profiler's and phase clock's when set (stages/profiling.py)."""
    return {k: v for k, v in os.environ.items() if k.startswith("NCCL_") or k in (
        "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "PYTHONPATH",
        "RAY_RUNTIME_TORCH_PROFILER_DIR", "RAY_RUNTIME_PROFILE_STEPS", "RAY_RUNTIME_SYNC_DEBUG",
        "RAY_RUNTIME_PHASE_CLOCK", "RAY_RUNTIME_SKINNY_GEMM")}


# ---- the memory-bandwidth roofline (roofline.py, throughput.py, latency.py) -------------------

def mem_bandwidth(device: str = "cuda", gib: float = 2.0, reps: int = 10) -> float:
    """Bytes/s of a large copy on `device`, read + write counted (STREAM "copy"): the ceiling a
    memory-bound decode step is held to. CUDA: device-to-device, timed with CUDA events; CPU:
    a host copy (informational: CPU decode is rarely bandwidth-bound)."""
    import torch

    src = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults / lazy allocation out of the timing
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            dst.copy_(src)
        end.record()
        end.synchronize()
        secs = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        secs = time.perf_counter() - t0
    n = src.numel()
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()  # give the copy's 2x gib back before the engine sizes its KV pool
    return 2 * n * reps / secs


def model_bytes(model_dir: str, dtype_bytes: int) -> tuple[int, int]:
    """(weight bytes one decode step reads, KV bytes per token of context), at `dtype_bytes`
    per element (the run's dtype, not the checkpoint's). Every weight is read once, except an
    untied input embedding: a step gathers only its rows. Tied, the LM head reads it whole."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    numel = 0
    for name in os.listdir(model_dir):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(model_dir, name), "rb") as f:  # header only: u64 length + JSON
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for key, t in header.items():
            if key == "__metadata__" or (key.endswith("embed_tokens.weight")
                                         and not cfg.get("tie_word_embeddings", False)):
                continue
            n = 1
            for d in t["shape"]:
                n *= d
            numel += n
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return numel * dtype_bytes, cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * dtype_bytes


def decode_step_bytes(weight_bytes: int, kv_per_token: int, prompt_lens: list[int],
                      out_lens: list[int]) -> list[int]:
    """Bytes read by each step of a simple schedule: all requests start together, step s
    (0 .. max output - 1) runs every request with output left to make, and reads the weights
    once plus each running request's KV of prompt + s tokens. Prefill is modelled as a step
    like the others (its compute, not bytes, is what bounds it; it is a small share here)."""
    steps = []
    for s in range(max(out_lens)):
        ctx = sum(p + s for p, o in zip(prompt_lens, out_lens) if o > s)
        steps.append(weight_bytes + ctx * kv_per_token)
    return steps
