"""stages/kv_budget.py (the KV budget on a GPU), run on the CPU with torch.cuda's memory calls
replaced: the dummy step runs through the last rank's sampler on its costliest setting, so the
sampler's buffers are in the activation peak the KV cache is sized around; with CUDA graphs the
graphs' pool is set aside too."""
from __future__ import annotations

import torch

from ray_runtime.config import EngineConfig
from stages.model_spec import ModelSpec
from ray_runtime.layer_span import LayerSpan
from stages.kv_budget import profile_kv_bytes
from stages.runner import StageRunner


def _runner(tiny_model, monkeypatch, **kw):
    model_dir = tiny_model("llama")
    spec = ModelSpec.from_dir(model_dir)
    cfg = EngineConfig(model=model_dir, max_num_batched_tokens=40, num_kv_blocks=50,
                       max_model_len=64, disable_log_stats=True, **kw)
    runner = StageRunner(cfg, 0, LayerSpan.of_layers(0, spec.num_layers), 64)
    for name, fake in [("empty_cache", lambda: None), ("reset_peak_memory_stats", lambda: None),
                       ("synchronize", lambda: None), ("mem_get_info", lambda: (8 << 30, 16 << 30)),
                       ("memory_allocated", lambda: 1 << 30), ("max_memory_allocated", lambda: 2 << 30)]:
        monkeypatch.setattr(torch.cuda, name, fake)
    return cfg, spec, runner


def test_memory_profile_runs_the_sampler_on_every_row(tiny_model, monkeypatch):
    cfg, spec, runner = _runner(tiny_model, monkeypatch, max_num_seqs=6)
    calls = []
    real = runner.last.sampler.sample

    def spy(logits, params, output_indices):
        calls.append((logits.shape, params))
        return real(logits, params, output_indices)

    monkeypatch.setattr(runner.last.sampler, "sample", spy)
    kv = profile_kv_bytes(runner)
    assert kv == int((16 << 30) * cfg.gpu_memory_utilization - (8 << 30) - (1 << 30))
    (shape, params), = calls
    assert shape == (6, spec.vocab_size)  # max_num_seqs rows (no drafts), the whole vocabulary
    assert all(not sp.is_greedy and sp.top_p < 1 and sp.top_k > 0 and sp.min_p > 0 for sp in params)
    assert any(sp.seed is not None for sp in params) and any(sp.seed is None for sp in params)


def test_graphs_pool_is_set_aside_for_the_largest_capture(tiny_model, monkeypatch):
    """With CUDA graphs the budget also leaves the pool of the largest capture (max_lane_size
    rows: its share of the activation peak, and on the last rank its greedy head's logits)."""
    cfg, spec, runner = _runner(tiny_model, monkeypatch, max_num_seqs=8)
    monkeypatch.setattr(StageRunner, "uses_cuda_graphs", property(lambda self: True))
    kv = profile_kv_bytes(runner)
    activations = 1 << 30
    pool = activations * 8 // 40 + 8 * spec.vocab_size * runner.dtype.itemsize
    assert kv == int((16 << 30) * cfg.gpu_memory_utilization - (8 << 30) - activations - pool)
