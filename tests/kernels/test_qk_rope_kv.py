"""The fused attention-inputs kernel (q and k normed and rotated, k and v written into the
KV cache, one launch) against the three kernels it replaces and the torch references, on CPU
through Triton's interpreter; bench/kernel_check.py checks bit-identity on the GPU."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.layer_ops import RopeCosSin, attention_inputs, rms_norm_ref, rope_ref  # noqa: E402
from kernels.layer_ops_triton import (  # noqa: E402
    norm_rope_triton_,
    qk_rope_kv_triton_,
    write_kv_triton,
)
from kernels.paged_attention import write_kv_ref  # noqa: E402

HEADS, KV_HEADS = 4, 2


def _tables(head_dim, num_positions, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat([torch.arange(num_positions).float()[:, None] * inv[None]] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _case(dtype, head_dim=32, tokens=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    # q, k, v as views of one projection's output, as the fused qkv GEMM leaves them
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * head_dim, generator=g).to(dtype)
    qkv = qkv.view(tokens, HEADS + 2 * KV_HEADS, head_dim)
    q, k, v = qkv[:, :HEADS], qkv[:, HEADS:HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS:]
    qw, kw = (torch.randn(head_dim, generator=g).to(dtype) for _ in range(2))
    positions = torch.tensor([0, 9, 3, 63, 17][:tokens])
    slots = torch.tensor([5, 0, 22, 9, 14][:tokens])  # out of order, across block edges
    caches = (torch.full((6, 4, KV_HEADS, head_dim), 7.0, dtype=dtype),
              torch.full((6, 4, KV_HEADS, head_dim), -7.0, dtype=dtype))
    return qkv, q, k, v, qw, kw, positions, slots, caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [True, False])
def test_fused_equals_the_three_kernels_it_replaces(dtype, with_norm):
    qkv, q, k, v, qw, kw, positions, slots, (kc, vc) = _case(dtype)
    if not with_norm:
        qw = kw = None
    cos, sin = _tables(32, 64, dtype)
    want_q = norm_rope_triton_(q.clone(), qw, 1e-6, cos[positions], sin[positions])
    want_k = norm_rope_triton_(k.clone(), kw, 1e-6, cos[positions], sin[positions])
    want_kc, want_vc = kc.clone(), vc.clone()
    write_kv_triton(want_kc, want_vc, want_k, v, slots)
    k_before = k.clone()
    got_q = qk_rope_kv_triton_(q, k, v, qw, kw, 1e-6, cos, sin, positions, kc, vc, slots)
    assert got_q.data_ptr() == q.data_ptr()  # in place on the projection's output
    assert torch.equal(got_q, want_q)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)  # and nowhere else
    assert torch.equal(k, k_before)  # k reaches the cache only


def test_fused_matches_the_torch_references():
    qkv, q, k, v, qw, kw, positions, slots, (kc, vc) = _case(torch.float32, head_dim=64, seed=3)
    cos, sin = _tables(64, 64, torch.float32)
    want_q = rope_ref(rms_norm_ref(q, qw, 1e-6), cos[positions], sin[positions])
    want_k = rope_ref(rms_norm_ref(k, kw, 1e-6), cos[positions], sin[positions])
    want_kc, want_vc = kc.clone(), vc.clone()
    write_kv_ref(want_kc, want_vc, want_k, v.contiguous(), slots)
    got_q = qk_rope_kv_triton_(q, k, v, qw, kw, 1e-6, cos, sin, positions, kc, vc, slots)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc, want_kc, rtol=1e-5, atol=1e-5)
    assert torch.equal(vc, want_vc)


def test_attention_inputs_without_tables_runs_the_ops_one_by_one():
    """The CPU (and float32) path: per-token cos/sin, the reference ops; the fused kernel
    only where tables are given, and tables off CUDA half precision are refused."""
    qkv, q, k, v, qw, kw, positions, slots, (kc, vc) = _case(torch.float32, seed=4)
    cos, sin = _tables(32, 64, torch.float32)
    want_q = rope_ref(rms_norm_ref(q, qw, 1e-6), cos[positions], sin[positions])
    want_k = rope_ref(rms_norm_ref(k, kw, 1e-6), cos[positions], sin[positions])
    want_kc, want_vc = kc.clone(), vc.clone()
    write_kv_ref(want_kc, want_vc, want_k, v.contiguous(), slots)
    got = attention_inputs(q, k, v, qw, kw, 1e-6, RopeCosSin(cos[positions], sin[positions]),
                           (kc, vc), slots)
    assert torch.equal(got, want_q) and torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    with pytest.raises(ValueError, match="rope tables"):
        attention_inputs(q, k, v, qw, kw, 1e-6, RopeCosSin(cos, sin, positions), (kc, vc), slots)


def test_fused_launcher_names_what_does_not_fit_and_launches_nothing_empty():
    qkv, q, k, v, qw, kw, positions, slots, (kc, vc) = _case(torch.float32)
    cos, sin = _tables(32, 64, torch.float32)
    bad = {
        "tables": dict(cos=cos[:, :16], sin=sin[:, :16]),
        "positions": dict(positions=positions[:3]),
        "slot_mapping": dict(slots=slots[:2]),
        "caches": dict(kc=kc[:, :, :1]),
        "norm weights": dict(kw=None),
        r"k \(": dict(k=k[:3]),
    }
    base = dict(q=q, k=k, v=v, qw=qw, kw=kw, cos=cos, sin=sin, positions=positions, kc=kc,
                vc=vc, slots=slots)
    for match, change in bad.items():
        a = {**base, **change}
        with pytest.raises(ValueError, match=match):
            qk_rope_kv_triton_(a["q"], a["k"], a["v"], a["qw"], a["kw"], 1e-6, a["cos"], a["sin"],
                               a["positions"], a["kc"], a["vc"], a["slots"])
    before = kc.clone()
    empty = torch.zeros(0, HEADS + 2 * KV_HEADS, 32)
    out = qk_rope_kv_triton_(empty[:, :HEADS], empty[:, HEADS:6], empty[:, 6:], qw, kw, 1e-6, cos,
                             sin, positions[:0], kc, vc, slots[:0])
    assert out.shape == (0, HEADS, 32) and torch.equal(kc, before)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: per-head q/k norms
def test_a_stage_with_rope_tables_equals_one_computing_cos_sin_per_step(tiny_model, arch,
                                                                         monkeypatch):
    """The model's wiring of the fused path (positions into the tables, the norms' weights,
    the caches) on CPU: the half-precision kernels forced on under the interpreter, a stage
    with rope tables (one launch per layer) against the same stage computing cos/sin each
    step (norm_rope on q and k, then write_kv): a prompt, then decode steps, bit for bit."""
    import numpy as np

    import kernels.layer_ops as layer_ops
    from ray_runtime.layer_span import stage_spans
    from stages.kv_cache import allocate_kv_cache
    from stages.model import attention_metadata, build_stage
    from stages.model_spec import ModelSpec

    monkeypatch.setattr(layer_ops, "_fused", lambda x: True)
    monkeypatch.setattr("kernels.paged_attention.write_kv",
                        lambda *a: write_kv_triton(*a))  # the CUDA path's write
    monkeypatch.setattr(layer_ops, "write_kv", lambda *a: write_kv_triton(*a))
    spec = ModelSpec.from_dir(tiny_model(arch))
    model = build_stage(spec, stage_spans(spec.num_layers, 1, None)[0], True, True, torch.bfloat16, "cpu")
    tables = model.rotary.tables(spec.max_position_embeddings, torch.bfloat16, "cpu")
    block_table = np.arange(12, dtype=np.int32).reshape(2, 6)
    runs = []
    for rope in (tables, None):
        model.rope_tables = rope
        kv = allocate_kv_cache(spec, spec.num_layers, 12, 4, torch.bfloat16, "cpu")
        ids, starts, num_new, outs = torch.arange(3, 3 + 11 + 7), np.array([0, 0]), \
            np.array([11, 7]), []
        for _ in range(3):
            meta, *_ = attention_metadata(block_table, np.arange(2), starts, num_new, 4, "cpu")
            outs.append(model(ids, meta, kv))
            starts, num_new = starts + num_new, np.array([1, 1])
            ids = torch.tensor([5, 9]) + len(outs)
        runs.append((outs, kv))
    (a, kva), (b, kvb) = runs
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x, y) for pa, pb in zip(kva, kvb) for x, y in zip(pa, pb))
    assert any(c.abs().sum() > 0 for c in kva[0])  # the caches were written at all


def test_rope_tables_cover_the_engine_s_positions_for_the_draft_model_too(tiny_root, monkeypatch):
    """Found in review: the tables were sized by each checkpoint's max_position_embeddings,
    and the fused kernel indexes them without a bound check. A draft model runs at the
    target's positions (up to its max_model_len), which its own checkpoint may not cover:
    every stage's tables, the draft's included, have the engine's max_model_len rows."""
    from ray_runtime.config import EngineConfig
    from ray_runtime.layer_span import LayerSpan
    import stages.model as model_mod
    from stages.model_spec import ModelSpec
    from stages.runner import StageRunner
    from tests.tiny_models import make_draft_model, make_tiny_model

    target = make_tiny_model("qwen2", tiny_root)
    draft = make_draft_model("qwen2", tiny_root)
    max_model_len = ModelSpec.from_dir(draft).max_position_embeddings + 100  # beyond the draft's
    built = []
    real = model_mod.build_stage

    def spy(spec, span, is_first, is_last, dtype, device, max_positions=None, **kw):
        built.append(max_positions)
        return real(spec, span, is_first, is_last, dtype, device, max_positions, **kw)

    monkeypatch.setattr(model_mod, "fused_kernels", lambda device, dtype: True)  # CPU: tables too
    monkeypatch.setattr("stages.runner.build_stage", spy)
    monkeypatch.setattr("stages.draft_model.build_stage", spy)
    spec = ModelSpec.from_dir(target)
    cfg = EngineConfig(model=target, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=64,
                       max_model_len=max_model_len, dtype="bfloat16", disable_log_stats=True,
                       speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                           "model": draft})
    runner = StageRunner(cfg, 0, LayerSpan.of_layers(0, spec.num_layers), max_model_len)
    assert built == [max_model_len, max_model_len]  # the target's stage, then the draft
    assert len(runner.model.rope_tables.cos) == max_model_len
    assert len(runner.last.drafter.model.rope_tables.cos) == max_model_len
