"""How many bytes of a stage's GPU the KV cache may take: gpu_memory_utilization of the
device, less what is in use (weights, the CUDA context, other processes), the activation
peak of the largest step and, with CUDA graphs, the graphs' memory pool, which is allocated
after the KV cache and stays (kv_block_capacity turns the bytes into blocks)."""
from __future__ import annotations

import numpy as np
import torch

from ray_runtime.sampling_params import SamplingParams
from stages.kv_cache import allocate_kv_cache
from stages.model import attention_metadata


@torch.inference_mode()
def profile_kv_bytes(runner) -> int:
    """A dummy step of max_num_batched_tokens tokens (in requests of at most max_model_len
    tokens) through the runner's stage with a throwaway KV cache gives the activation peak;
    on the last rank it also computes the logits of every row that may sample and runs the
    sampler on its costliest setting. Then graph_pool_bytes is set aside."""
    cfg = runner.config
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    n = cfg.max_num_batched_tokens
    longest = runner.batch.max_model_len
    lens = [longest] * (n // longest) + ([n % longest] if n % longest else [])
    bs = cfg.block_size
    per_req = -(-max(lens) // bs)
    table = np.arange(len(lens) * per_req, dtype=np.int32).reshape(len(lens), per_req)
    caches = allocate_kv_cache(runner.spec, runner.num_layers, table.size, bs, runner.dtype,
                               runner.device)
    meta, _, _, _ = attention_metadata(table, np.arange(len(lens)), np.zeros(len(lens), np.int64),
                                       np.array(lens, np.int64), bs, runner.device)
    x = torch.zeros(n, dtype=torch.long, device=runner.device) if runner.is_first else \
        torch.zeros(n, runner.spec.hidden_size, dtype=runner.dtype, device=runner.device)
    hidden = runner.model(x, meta, caches)
    if runner.is_last:  # logits of every row that may sample, drafts included, and the
        # sampler's own buffers on them (its costliest setting: top-k, top-p, min-p, seeds)
        rows = min(n, cfg.max_num_seqs * (1 + cfg.num_speculative_tokens))
        logits = runner.model.compute_logits(hidden[:rows])
        worst = [SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05,
                                seed=i if i % 2 else None) for i in range(rows)]
        runner.last.sampler.sample(logits, worst, [0] * rows)
        del logits
    torch.cuda.synchronize()
    activations = torch.cuda.max_memory_allocated() - before
    del caches, hidden, x
    torch.cuda.empty_cache()
    graphs = graph_pool_bytes(runner, activations) if runner.uses_cuda_graphs else 0
    return int(total * cfg.gpu_memory_utilization - (total - free) - activations - graphs)


def graph_pool_bytes(runner, activations: int) -> int:
    """An estimate of what the decode graphs keep (stages/cuda_graphs.py: one pool, sized by
    the largest capture of max_lane_size rows): that many rows' share of the dummy step's
    activation peak (a forward's activations grow with its tokens) and, on the last rank,
    the greedy head's logits of those rows in the model's dtype."""
    cfg = runner.config
    rows = min(cfg.max_lane_size, cfg.max_num_batched_tokens)
    pool = activations * rows // max(1, cfg.max_num_batched_tokens)
    if runner.is_last:
        pool += rows * runner.spec.vocab_size * runner.dtype.itemsize
    return pool
