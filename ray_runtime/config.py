"""One frozen engine configuration: every knob lives here, none in environment variables."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    pipeline_parallel_size: int = 1
    pp_layer_partition: Optional[tuple[int, ...]] = None  # layers per stage; None: even split
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_kv_blocks: Optional[int] = None  # None: size the pool from memory
    kv_cache_memory_fraction: float = 0.1  # of free host memory (cpu) / device memory (cuda)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256
    max_model_len: Optional[int] = None  # None: the checkpoint's max_position_embeddings
    async_scheduling: bool = True
    on_mismatch: str = "repair"  # what the driver does when a rank's digest disagrees: or "raise"
    trace_file: Optional[str] = None  # Chrome trace / Perfetto JSON of the pipeline
    placement_strategy: str = "PACK"
    num_cpus_per_stage: float = 1.0
    torch_threads_per_stage: int = 1
    debug_checks: bool = False  # run every InputBatch.check() each step
    placement_timeout_s: float = 60.0

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
        if self.on_mismatch not in ("repair", "raise"):
            raise bad("on_mismatch", f"must be 'repair' or 'raise', got {self.on_mismatch!r}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise bad("kv_cache_memory_fraction", f"must be in (0, 1], got {self.kv_cache_memory_fraction}")


def parse_partition(value: str | tuple[int, ...] | list[int] | None) -> Optional[tuple[int, ...]]:
    """'3,2,2' or [3, 2, 2] -> (3, 2, 2); validated against the model in `stage_layer_ranges`."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            return tuple(int(x) for x in value.split(","))
        except ValueError:
            raise ValueError(f"pp_layer_partition must be comma-separated integers, got {value!r}") from None
    return tuple(int(x) for x in value)


def stage_layer_ranges(num_layers: int, pp_size: int,
                       partition: Optional[tuple[int, ...]]) -> list[tuple[int, int]]:
    """[start, end) of decoder layers per stage. Even split puts the extra layers on the
    earliest stages, since the last stage also carries the LM head and the sampler."""
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size ({pp_size}) exceeds the model's "
                         f"num_hidden_layers ({num_layers})")
    if partition is None:
        base, extra = divmod(num_layers, pp_size)
        partition = tuple(base + (1 if r < extra else 0) for r in range(pp_size))
    if len(partition) != pp_size:
        raise ValueError(f"pp_layer_partition has {len(partition)} entries but "
                         f"pipeline_parallel_size is {pp_size}")
    if any(n < 1 for n in partition):
        raise ValueError(f"pp_layer_partition entries must be >= 1, got {list(partition)}")
    if sum(partition) != num_layers:
        raise ValueError(f"pp_layer_partition {list(partition)} sums to {sum(partition)}, "
                         f"but the model has num_hidden_layers={num_layers}")
    ranges, start = [], 0
    for n in partition:
        ranges.append((start, start + n))
        start += n
    return ranges


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
