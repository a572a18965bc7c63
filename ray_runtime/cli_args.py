"""The CLI's engine flags, made from EngineConfig's fields: one flag per field, its default
the field's (shown in --help, never copied here), so the CLI, LLM and AsyncLLM cannot
disagree. Only the flags given reach the config; the rest keep EngineConfig's defaults."""
from __future__ import annotations

import argparse
import dataclasses
import json

from ray_runtime.config import SUPPORTED_DTYPES, EngineConfig

HELP = {
    "pipeline_parallel_size": "pipeline stages (one Ray actor each)",
    "pp_layer_partition": 'decoder layers per stage, halves allowed, e.g. "3,2,2" or "16.5,15.5"; '
                          '"even" (the same number of layers on every stage) or "balanced" (the '
                          'default: the last stage\'s LM head counted as one layer)',
    "pp_prefill_partition": 'a prefill-shaped step\'s layers per stage: "auto" (the default: an '
                            'MLP block at a boundary moves where that evens the stages\' prefill '
                            'work), "same" (the decode split\'s) or numbers that keep each stage\'s '
                            'attention layers',
    "device": "where the stages run",
    "dtype": "weights and activations",
    "block_size": "tokens per KV block",
    "num_kv_blocks": "KV pool size in blocks (default: sized from memory)",
    "kv_cache_memory_fraction": "cpu: share of available host memory for the KV pool",
    "gpu_memory_utilization": "cuda: share of each GPU the engine may fill",
    "enforce_eager": "cuda: never replay CUDA graphs",
    "max_num_seqs": "requests running at once",
    "max_num_batched_tokens": "tokens per step (chunked prefill budget)",
    "max_model_len": "longest prompt + output (default: the checkpoint's)",
    "async_scheduling": "plan the next step while the current one runs",
    "max_inflight_steps": "async: steps in flight; default 2 at PP=1, 2 x PP at PP>1 (PP with drafts)",
    "pp_token_feedback": "PP>1 async: the last rank sends sampled tokens straight to rank 0",
    "on_mismatch": "what a bookkeeping mismatch does",
    "trace_file": "write a Chrome-trace / Perfetto JSON of the pipeline here",
    "placement_strategy": "placement-group strategy of the stage bundles",
    "num_cpus_per_stage": "logical CPUs each stage's bundle asks for",
    "torch_threads_per_stage": "torch intra-op threads per stage",
    "debug_checks": "every invariant check every step (slow)",
    "digest_full_every": "every n-th digest of a request rehashes its whole row",
    "placement_timeout_s": "how long to wait for the stages to be placed",
    "step_timeout_s": "a stage silent this long is lost (and replaced)",
    "max_stage_restarts": "lost-stage replacements before unfinished requests fail",
    "speculative_config": 'JSON, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    "disable_log_stats": "record no engine metrics (ray.util.metrics)",
    "address": 'the Ray cluster to join ("host:port", "auto"); default RAY_ADDRESS, else a '
               "private local one",
}
CHOICES = {"device": ("cpu", "cuda"), "dtype": SUPPORTED_DTYPES, "on_mismatch": ("repair", "raise"),
           "placement_strategy": ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")}
SHORT = {"pipeline_parallel_size": "-pp"}


def _json(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None


def _type_of(field: dataclasses.Field):
    if field.name == "speculative_config":
        return _json
    if field.name in ("pp_layer_partition", "pp_prefill_partition"):
        return str  # parsed by EngineConfig.from_kwargs
    t = str(field.type)
    return int if "int" in t else float if "float" in t else str


def engine_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineConfig) if f.name != "model"]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model folder (default: the demo SmolLM2)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    for f in engine_fields():
        flags = ["--" + f.name.replace("_", "-")] + ([SHORT[f.name]] if f.name in SHORT else [])
        help_ = f"{HELP.get(f.name, f.name)} (default: {f.default})"
        if str(f.type) == "bool":
            p.add_argument(*flags, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=help_)
        else:
            p.add_argument(*flags, type=_type_of(f), choices=CHOICES.get(f.name),
                           default=argparse.SUPPRESS, help=help_)
    p.add_argument("--sync", dest="async_scheduling", action="store_false",
                   default=argparse.SUPPRESS, help="same as --no-async-scheduling")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig fields given on the command line."""
    return {f.name: getattr(args, f.name) for f in engine_fields() if hasattr(args, f.name)}
