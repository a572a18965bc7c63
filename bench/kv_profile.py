"""The GPU KV pool sized by the profiling pass: for each gpu_memory_utilization, build a
Qwen3-0.6B-shaped stage, ask it for its KV capacity, allocate that, and read how full the
device is.

  python bench/kv_profile.py
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import save  # noqa: E402
from bench.gpu_check import qwen3_dir  # noqa: E402
from ray_runtime.config import EngineConfig  # noqa: E402
from stages.kv_cache import bytes_per_block  # noqa: E402
from ray_runtime.layer_span import LayerSpan  # noqa: E402
from stages.runner import StageRunner  # noqa: E402


def main() -> None:
    model = qwen3_dir("/tmp/ray_runtime_gpu", 28, torch.bfloat16, small=False)
    rows = []
    for util in (0.9, 0.5):
        cfg = EngineConfig(model=model, device="cuda", dtype="bfloat16", max_num_batched_tokens=8192,
                           max_num_seqs=256, gpu_memory_utilization=util)
        runner = StageRunner(cfg, 0, LayerSpan.of_layers(0, 28), 2064)
        n = runner.kv_block_capacity()
        runner.init_kv_cache(n)
        free, total = torch.cuda.mem_get_info()
        rows.append({"gpu_memory_utilization": util, "kv_blocks": n,
                     "kv_GiB": n * bytes_per_block(runner.spec, 28, 16, torch.bfloat16) / 2 ** 30,
                     "device_used_fraction_after_alloc": round((total - free) / total, 3),
                     "total_GiB": total / 2 ** 30})
        print(json.dumps(rows[-1]), flush=True)
        del runner
        torch.cuda.empty_cache()
    print("wrote", save("kv_profile", {"model": "Qwen3-0.6B shape, bf16, random", "rows": rows}))


if __name__ == "__main__":
    main()
