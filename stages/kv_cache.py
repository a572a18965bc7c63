"""The stage's KV pool: for each of its layers, key and value blocks of
[num_blocks, block_size, num_kv_heads, head_dim]. Block ids are global (one allocator in the
driver's scheduler); every stage holds the same number of blocks for its own layers."""
from __future__ import annotations

import os

import torch

from stages.model_spec import ModelSpec


def bytes_per_block(spec: ModelSpec, num_layers: int, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * num_layers * block_size * spec.num_kv_heads * spec.head_dim * elem


def available_host_kv_bytes(fraction: float) -> int:
    """CPU: the share of available host memory the pool may take (on CUDA the runner
    profiles the device instead: stages/kv_budget.py)."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        free = info.get("MemAvailable", info["MemFree"])
    except OSError:
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return int(free * fraction)


def allocate_kv_cache(spec: ModelSpec, num_layers: int, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)]
