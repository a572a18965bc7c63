"""Shared bench plumbing: results as JSON in bench/results/, with the command that made them."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys

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
    """The variables every Ray worker needs on the multi-GPU machines (NVLink multicast off)."""
    return {k: os.environ[k] for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                       "NVSHMEM_DISABLE_NVLS", "PYTHONPATH") if k in os.environ}
