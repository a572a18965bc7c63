"""One frozen engine configuration: every knob lives here, none in environment variables."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from ray_runtime.layer_span import parse_partition, parse_prefill_partition

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


SPEC_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config dict, validated: {"method": "ngram", "num_speculative_tokens":
    k, "prompt_lookup_min": 1, "prompt_lookup_max": 4} or {"method": "draft_model", "model":
    DIR, "num_speculative_tokens": k}."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: Optional[str] = None  # the draft checkpoint (draft_model)

    @classmethod
    def from_dict(cls, d: "dict | SpeculativeConfig | None") -> "Optional[SpeculativeConfig]":
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}
        extra = set(d) - known
        if extra:
            raise ValueError(f"speculative_config: unknown keys {sorted(extra)}; known: {sorted(known)}")
        if "method" not in d or "num_speculative_tokens" not in d:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        return cls(**d)

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"speculative_config.{field} {why}")

        if self.method not in SPEC_METHODS:
            raise bad("method", f"must be one of {SPEC_METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise bad("num_speculative_tokens", f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not isinstance(lo, int) or lo < 1:
                raise bad("prompt_lookup_min", f"must be an integer >= 1, got {lo!r}")
            if not isinstance(hi, int) or hi < lo:
                raise bad("prompt_lookup_max", f"must be an integer >= prompt_lookup_min ({lo}), got {hi!r}")
            if self.model is not None:
                raise bad("model", "is only for method 'draft_model'")
        elif not self.model or not os.path.isfile(os.path.join(self.model, "config.json")):
            raise bad("model", f"must be a checkpoint folder with a config.json, got {self.model!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    pipeline_parallel_size: int = 1
    # layers per stage, halves allowed, or "even"; None: "balanced" (ray_runtime/layer_span.py)
    pp_layer_partition: Optional[tuple[float, ...] | str] = None
    # a prefill-shaped step's split: None ("auto": an MLP block at a boundary moves where
    # that evens the stages' prefill work), "same" (decode's), or layers per stage
    pp_prefill_partition: Optional[tuple[float, ...] | str] = None
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_kv_blocks: Optional[int] = None  # None: size the pool from memory
    kv_cache_memory_fraction: float = 0.1  # cpu: the share of available host memory for KV
    # cuda: the share of each GPU the engine may fill (weights + profiled activations + KV)
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # cuda: never replay CUDA graphs (decode steps use them by default)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256
    max_model_len: Optional[int] = None  # None: the checkpoint's max_position_embeddings
    async_scheduling: bool = True
    # async: steps in flight at once. None: PP=1 keeps 2 (the next step runs on the pending
    # sample); PP>1 keeps two per micro-batch (2 x PP: each micro-batch's next step is planned
    # on its pending samples, which the last rank feeds straight back to rank 0), or one per
    # stage with speculative decoding (a request then waits for its token and drafts).
    max_inflight_steps: Optional[int] = None
    # PP>1 async: the last rank sends its samples straight to rank 0 (off: a request waits
    # for the driver to send its token, the layout before; for comparisons and debugging)
    pp_token_feedback: bool = True
    on_mismatch: str = "repair"  # what the driver does when a rank's digest disagrees: or "raise"
    trace_file: Optional[str] = None  # Chrome trace / Perfetto JSON of the pipeline
    placement_strategy: str = "PACK"
    num_cpus_per_stage: float = 1.0
    torch_threads_per_stage: int = 1
    debug_checks: bool = False  # run every InputBatch.check() each step, and full digests
    # The ranks' digests move each request's hash by its new tokens; at every this-many-th
    # digest of a request (and every step under debug_checks) they recompute it from the
    # whole row, which is what catches a cell corrupted behind every write path's back.
    digest_full_every: int = 16
    placement_timeout_s: float = 60.0
    # A stage that does not answer a step within this long is an error naming its rank
    # (the first steps on a GPU include kernel compilation: keep it generous).
    step_timeout_s: float = 300.0
    # A lost stage (its process or node died, or it stalled past step_timeout_s) is replaced
    # and every unfinished request recomputed from its tokens, at most this many times per
    # engine; past that, unfinished requests fail with the error.
    max_stage_restarts: int = 3
    speculative_config: Optional[SpeculativeConfig] = None
    # vLLM's name: no engine metrics (ray.util.metrics, docs/operations.md) are recorded
    disable_log_stats: bool = False
    # The Ray cluster to join (ray_runtime/cluster.py, connect_ray): "host:port", "auto" (the
    # `ray start` cluster on this machine) or "ray://..."; None: RAY_ADDRESS if set, else a
    # private local cluster. Ignored by a process that already called ray.init.
    address: Optional[str] = None

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        """The config from LLM / AsyncLLM keywords (the defaults are this class's, nowhere
        else): a trace_file is made absolute, a "3,2,2" partition parsed, and an unknown
        keyword is a ValueError naming it and its nearest known names."""
        import difflib
        import dataclasses

        known = {f.name for f in dataclasses.fields(cls)} - {"model"}
        for key in kwargs:
            if key not in known:
                near = difflib.get_close_matches(key, sorted(known), n=3)
                raise ValueError(f"unknown engine option {key!r}"
                                 + (f"; did you mean {', '.join(near)}?" if near else
                                    f"; known: {', '.join(sorted(known))}"))
        if kwargs.get("trace_file") is not None:
            kwargs["trace_file"] = os.path.abspath(kwargs["trace_file"])
        if "pp_layer_partition" in kwargs:
            kwargs["pp_layer_partition"] = parse_partition(kwargs["pp_layer_partition"])
        if "pp_prefill_partition" in kwargs:
            kwargs["pp_prefill_partition"] = parse_prefill_partition(kwargs["pp_prefill_partition"])
        return cls(model=model, **kwargs)

    @property
    def inflight_steps(self) -> int:
        """Steps the driver keeps in flight (max_inflight_steps, or its default; 1 in sync)."""
        if not self.async_scheduling:
            return 1
        return self.max_inflight_steps or default_inflight_steps(self.pipeline_parallel_size,
                                                                 self.feeds_tokens_back)

    @property
    def feeds_tokens_back(self) -> bool:
        """PP>1 async without drafts: the last rank sends each step's sampled tokens straight
        to rank 0 (stages/token_feedback.py), so a micro-batch's next step is planned on its
        pending samples and never waits for a driver round trip (docs/design.md)."""
        return (self.pipeline_parallel_size > 1 and self.async_scheduling
                and self.speculative_config is None and self.pp_token_feedback)

    @property
    def num_microbatches(self) -> int:
        """Disjoint groups of requests (lanes) whose steps take turns in the pipeline: one per
        stage when tokens feed back; otherwise 1 (at PP>1 without feedback the requests split
        by themselves: a request waits for its token)."""
        return self.pipeline_parallel_size if self.feeds_tokens_back else 1

    @property
    def max_lane_size(self) -> int:
        """The most requests one micro-batch (lane) holds, so the most rows a decode step
        has: what a stage's decode graphs are captured up to."""
        return lane_capacity(self.max_num_seqs, self.num_microbatches)

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"{field} {why}")

        if self.pipeline_parallel_size < 1:
            raise bad("pipeline_parallel_size", f"must be >= 1, got {self.pipeline_parallel_size}")
        if self.device not in ("cpu", "cuda"):
            raise bad("device", f"must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise bad("dtype", f"must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.block_size < 1:
            raise bad("block_size", f"must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise bad("num_kv_blocks", f"must be >= 1, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1:
            raise bad("max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise bad("max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}")
        if self.placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise bad("placement_strategy", f"must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD, "
                                            f"got {self.placement_strategy!r}")
        if self.max_inflight_steps is not None and self.max_inflight_steps < 1:
            raise bad("max_inflight_steps", f"must be >= 1, got {self.max_inflight_steps}")
        if not isinstance(self.digest_full_every, int) or self.digest_full_every < 1:
            raise bad("digest_full_every", f"must be an integer >= 1, got {self.digest_full_every!r}")
        if not isinstance(self.max_stage_restarts, int) or self.max_stage_restarts < 0:
            raise bad("max_stage_restarts", f"must be an integer >= 0, got {self.max_stage_restarts!r}")
        if not self.step_timeout_s > 0:
            raise bad("step_timeout_s", f"must be > 0, got {self.step_timeout_s}")
        if not isinstance(self.pp_token_feedback, bool):
            raise bad("pp_token_feedback", f"must be a bool, got {self.pp_token_feedback!r}")
        if not isinstance(self.disable_log_stats, bool):
            raise bad("disable_log_stats", f"must be a bool, got {self.disable_log_stats!r}")
        if self.address is not None and (not isinstance(self.address, str) or not self.address):
            raise bad("address", f"must be a non-empty string or None, got {self.address!r}")
        if not self.num_cpus_per_stage > 0:
            raise bad("num_cpus_per_stage", f"must be > 0, got {self.num_cpus_per_stage}")
        if self.on_mismatch not in ("repair", "raise"):
            raise bad("on_mismatch", f"must be 'repair' or 'raise', got {self.on_mismatch!r}")
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.from_dict(self.speculative_config))
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise bad("kv_cache_memory_fraction", f"must be in (0, 1], got {self.kv_cache_memory_fraction}")


def lane_capacity(requests: int, num_lanes: int) -> int:
    """One lane's share of `requests` split over num_lanes lanes (rounded up). Of
    max_num_seqs: the most one lane ever holds; the scheduler admits into a lane up to its
    share of the requests that can run."""
    return -(-requests // num_lanes)


def default_inflight_steps(pp: int, feeds_tokens_back: bool = True) -> int:
    """2 at PP=1; 2 x PP with token feedback (every micro-batch has its running step and its
    next step, planned on pending samples, in flight); PP without it."""
    if pp == 1:
        return 2
    return 2 * pp if feeds_tokens_back else pp


def load_hf_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model: no config.json in {model_dir!r}")
    with open(path) as f:
        cfg = json.load(f)
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"model: architecture {arch!r} is not supported; supported: "
                         f"{sorted(SUPPORTED_ARCHITECTURES)}")
    return cfg
