"""The Triton kernels against their torch references on the GPU, at real model shapes (the
CPU tests run the same comparisons on small shapes under TRITON_INTERPRET=1).

  python bench/kernel_check.py

- paged decode attention (Qwen3-0.6B: 16 q / 8 kv heads; Llama-3-8B: 32 / 8; head_dim 128;
  bf16 and fp16; 64 rows, contexts 1-2048, block 16, shuffled blocks) vs the float32 torch
  reference: max abs error;
- paged prefill attention (chunks of 100-1024 tokens over cached prefixes of 0-1024, 16
  requests, same head shapes and dtypes) vs the float32 reference: max abs error;
- rejection sampler (vocab 151936, k = 4, 64 requests; greedy, n-gram and draft-model rows
  mixed) vs the torch reference: emitted tokens must be identical.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import save  # noqa: E402
from kernels.decode_attention_triton import paged_decode_attention  # noqa: E402
from kernels.paged_attention import decode_attention_batched, paged_attention_ref  # noqa: E402
from kernels.prefill_attention_triton import prefill_attention  # noqa: E402
from kernels.rejection_sampler import rejection_sample_ref  # noqa: E402
from kernels.rejection_sampler_triton import rejection_sample_triton  # noqa: E402


def attention_case(heads: int, kv_heads: int, dtype: torch.dtype, rows: int = 64,
                   block: int = 16, max_ctx: int = 2048, head_dim: int = 128) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(heads * 7 + kv_heads)
    seq_lens = torch.randint(1, max_ctx + 1, (rows,), device="cuda", generator=gen)
    seq_lens[0], seq_lens[1] = 1, max_ctx  # one-token context and a full one
    blocks_per_row = -(-max_ctx // block)
    num_blocks = rows * blocks_per_row
    tables = torch.randperm(num_blocks, device="cuda", generator=gen).view(rows, blocks_per_row)
    k = torch.randn(num_blocks, block, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    v = torch.randn(num_blocks, block, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    q = torch.randn(rows, heads, head_dim, device="cuda", generator=gen).to(dtype)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, k, v, tables, seq_lens, scale)
    ref = decode_attention_batched(q.float(), k.float(), v.float(), tables, seq_lens, scale)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        paged_decode_attention(q, k, v, tables, seq_lens, scale)
    torch.cuda.synchronize()
    return {"heads": heads, "kv_heads": kv_heads, "dtype": str(dtype), "rows": rows,
            "max_abs_err": float((out.float() - ref).abs().max()),
            "kernel_us": (time.perf_counter() - t0) / 20 * 1e6}


def prefill_case(heads: int, kv_heads: int, dtype: torch.dtype, block: int = 16,
                 head_dim: int = 128) -> dict:
    """Chunks of 100-1024 tokens over cached prefixes of 0-1024 tokens, 16 requests."""
    gen = torch.Generator(device="cuda").manual_seed(heads + 3 * kv_heads)
    chunks = torch.randint(100, 1025, (16,), generator=gen, device="cuda").tolist()
    prefixes = torch.randint(0, 1025, (16,), generator=gen, device="cuda").tolist()
    prefixes[0] = 0
    seq_lens = [c + p for c, p in zip(chunks, prefixes)]
    per_req = [-(-n // block) for n in seq_lens]
    tables = torch.randperm(sum(per_req), device="cuda", generator=gen)
    table = torch.zeros(16, max(per_req), dtype=torch.int64, device="cuda")
    used = 0
    for i, n in enumerate(per_req):
        table[i, :n] = tables[used:used + n]
        used += n
    k = torch.randn(sum(per_req), block, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    v = torch.randn(sum(per_req), block, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    qsl = [0]
    for c in chunks:
        qsl.append(qsl[-1] + c)
    q = torch.randn(qsl[-1], heads, head_dim, device="cuda", generator=gen).to(dtype)
    scale = head_dim ** -0.5
    out = torch.empty_like(q)
    prefill_attention(q, k, v, table, seq_lens, qsl, list(range(16)), out, scale)
    ref = paged_attention_ref(q.float(), k.float(), v.float(), table, seq_lens, qsl, scale)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        prefill_attention(q, k, v, table, seq_lens, qsl, list(range(16)), out, scale)
    torch.cuda.synchronize()
    kernel_s = (time.perf_counter() - t0) / 10
    t0 = time.perf_counter()
    for _ in range(3):
        paged_attention_ref(q, k, v, table, seq_lens, qsl, scale)
    torch.cuda.synchronize()
    return {"heads": heads, "kv_heads": kv_heads, "dtype": str(dtype), "tokens": qsl[-1],
            "max_abs_err": float((out.float() - ref).abs().max()),
            "kernel_us": kernel_s * 1e6, "torch_loop_us": (time.perf_counter() - t0) / 3 * 1e6}


def split_case(num_splits: int, dtype: torch.dtype) -> dict:
    """Few rows over long contexts (flash-decoding splits), against the float32 reference."""
    gen = torch.Generator(device="cuda").manual_seed(num_splits)
    rows, ctx, block = 4, 4096, 16
    per = ctx // block
    tables = torch.randperm(rows * per, device="cuda", generator=gen).view(rows, per)
    k = torch.randn(rows * per, block, 8, 128, device="cuda", generator=gen).to(dtype)
    v = torch.randn(rows * per, block, 8, 128, device="cuda", generator=gen).to(dtype)
    q = torch.randn(rows, 32, 128, device="cuda", generator=gen).to(dtype)
    lens = torch.tensor([1, 100, 2049, 4096], device="cuda")
    out = paged_decode_attention(q, k, v, tables, lens, 128 ** -0.5, num_splits=num_splits)
    ref = decode_attention_batched(q.float(), k.float(), v.float(), tables, lens, 128 ** -0.5)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        paged_decode_attention(q, k, v, tables, lens, 128 ** -0.5, num_splits=num_splits)
    torch.cuda.synchronize()
    return {"num_splits": num_splits, "dtype": str(dtype),
            "max_abs_err": float((out.float() - ref).abs().max()),
            "kernel_us": (time.perf_counter() - t0) / 20 * 1e6}


def layer_ops_case(dtype: torch.dtype) -> dict:
    """The fused layer kernels against the unfused torch ops on the GPU (the CPU tests can only
    check bf16 closeness: the interpreter truncates where the GPU rounds). Fraction of
    elements bit-identical, and the largest difference."""
    from kernels.layer_ops import rms_norm_ref, rope_ref
    from kernels.layer_ops_triton import (norm_rope_triton_, qk_rope_kv_triton_, rms_norm_triton,
                                          silu_and_mul_triton, write_kv_triton)
    from kernels.paged_attention import write_kv_ref

    gen = torch.Generator(device="cuda").manual_seed(5)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)

    def compare(got, want):
        return {"equal_fraction": float((got == want).float().mean()),
                "max_abs_diff": float((got.float() - want.float()).abs().max())}

    x, r, w = rnd(256, 1024, scale=3), rnd(256, 1024), rnd(1024)
    out = {"rms_norm": compare(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))}
    n, s = rms_norm_triton(x, w, 1e-6, residual=r)
    out["add_rms_norm"] = compare(n, rms_norm_ref(r + x, w, 1e-6))
    out["add_rms_norm_sum"] = compare(s, r + x)
    q, qw = rnd(256, 16, 128), rnd(128)
    pos = torch.arange(256, device="cuda").float() * 7
    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
    emb = torch.cat([pos[:, None] * inv[None]] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    out["rope"] = compare(norm_rope_triton_(q.clone(), None, 1e-6, cos, sin), rope_ref(q, cos, sin))
    out["qk_norm_rope"] = compare(norm_rope_triton_(q.clone(), qw, 1e-6, cos, sin),
                                  rope_ref(rms_norm_ref(q, qw, 1e-6), cos, sin))
    g, u = rnd(256, 3072, scale=3), rnd(256, 3072)
    out["silu_and_mul"] = compare(silu_and_mul_triton(g, u), torch.nn.functional.silu(g) * u)
    kc, vc = rnd(64, 16, 8, 128), rnd(64, 16, 8, 128)
    kr, vr = kc.clone(), vc.clone()
    k, v = rnd(256, 8, 128), rnd(256, 8, 128)
    slots = torch.randperm(64 * 16, device="cuda", generator=gen)[:256]
    write_kv_triton(kc, vc, k, v, slots)
    write_kv_ref(kr, vr, k, v, slots)
    out["write_kv"] = {"identical": bool(torch.equal(kc, kr) and torch.equal(vc, vr))}
    # q, k and v as views of one projection, cos/sin as tables indexed by position: the fused
    # launch against the three kernels it replaces, which must agree bit for bit
    qkv = rnd(256, (16 + 2 * 8) * 128).view(256, 32, 128)
    kw, positions = rnd(128), (torch.arange(256, device="cuda") * 7)[torch.randperm(256, device="cuda", generator=gen)]
    table = torch.cat([torch.arange(256 * 7, device="cuda").float()[:, None] * inv[None]] * 2, dim=-1)
    cos_t, sin_t = table.cos().to(dtype), table.sin().to(dtype)
    want_q = norm_rope_triton_(qkv[:, :16].clone(), qw, 1e-6, cos_t[positions], sin_t[positions])
    want_k = norm_rope_triton_(qkv[:, 16:24].clone(), kw, 1e-6, cos_t[positions], sin_t[positions])
    kc2, vc2 = kr.clone(), vr.clone()
    write_kv_triton(kr, vr, want_k, qkv[:, 24:], slots)
    got_q = qk_rope_kv_triton_(qkv[:, :16], qkv[:, 16:24], qkv[:, 24:], qw, kw, 1e-6, cos_t,
                               sin_t, positions, kc2, vc2, slots)
    out["qk_rope_kv"] = {"identical": bool(torch.equal(got_q, want_q) and torch.equal(kc2, kr)
                                           and torch.equal(vc2, vr))}
    return {"dtype": str(dtype), **out}


def stage_rope_tables_case(root: str = "/tmp/ray_runtime_gpu") -> dict:
    """A bf16 stage's forward with its rope tables (one fused launch for q/k norm, rotary and
    the KV write per layer) against the same stage without them (cos/sin per step, three
    launches): a prompt, then decode steps; logits-side hidden states and caches identical."""
    import numpy as np

    from bench.common import tiny_llama
    from ray_runtime.layer_span import stage_spans
    from stages.kv_cache import allocate_kv_cache
    from stages.model import attention_metadata, build_stage
    from stages.model_spec import ModelSpec

    spec = ModelSpec.from_dir(tiny_llama(os.path.join(root, "llama_rope_check"), hidden=512,
                                         layers=2, heads=8, kv_heads=2, intermediate=1024,
                                         vocab=1000))
    model = build_stage(spec, stage_spans(spec.num_layers, 1, None)[0], True, True, torch.bfloat16, "cuda")
    tables = model.rope_tables
    table = np.arange(32, dtype=np.int32).reshape(2, 16)
    results = {}
    for name, rope in (("tables", tables), ("per_step", None)):
        model.rope_tables = rope
        kv = allocate_kv_cache(spec, spec.num_layers, 32, 16, torch.bfloat16, "cuda")
        outs, ids = [], torch.arange(3, 3 + 2 * 40, device="cuda") % 1000
        starts, num_new = np.array([0, 0]), np.array([40, 40])
        for step in range(4):
            meta, *_ = attention_metadata(table, np.arange(2), starts, num_new, 16, "cuda")
            outs.append(model(ids, meta, kv))
            starts, num_new = starts + num_new, np.array([1, 1])
            ids = outs[-1][-2:].float().sum(-1).long().abs() % 1000
        results[name] = (outs, kv)
    model.rope_tables = tables
    (a, kva), (b, kvb) = results["tables"], results["per_step"]
    same = all(torch.equal(x, y) for x, y in zip(a, b)) and \
        all(torch.equal(x, y) for pa, pb in zip(kva, kvb) for x, y in zip(pa, pb))
    return {"identical": bool(same), "max_abs_diff": max(float((x.float() - y.float()).abs().max())
                                                         for x, y in zip(a, b))}


def skinny_gemm_case(rows: int, k: int, n: int) -> dict:
    """The skinny GEMM against torch's (cuBLAS) at a decode step's few rows: error against a
    float32 matmul, next to cuBLAS's own, and each one's time per call (a CUDA graph of 50
    calls, so launch gaps are the device's, as in a decode step's graph)."""
    from kernels.skinny_gemm_triton import skinny_linear

    gen = torch.Generator(device="cuda").manual_seed(rows * k + n)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(torch.bfloat16)
    ref = x.float() @ w.float().T
    out = {"rows": rows, "k": k, "n": n}
    for name, fn in (("skinny", lambda: skinny_linear(x, w)),
                     ("torch", lambda: torch.nn.functional.linear(x, w))):
        y = fn()
        out[f"{name}_max_abs_err"] = float((y.float() - ref).abs().max())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(50):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
        out[f"{name}_us"] = (time.perf_counter() - t0) / 500 * 1e6
    out["skinny_GBps"] = n * k * 2 / out["skinny_us"] / 1e3
    return out


def rejection_case(seed: int, B: int = 64, K: int = 4, V: int = 151936) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num_drafts = torch.randint(0, K + 1, (B,), device="cuda", generator=gen)
    logits = torch.randn(B, K + 1, V, device="cuda", generator=gen) * 3
    target_probs = torch.softmax(logits, -1)
    target_argmax = logits.argmax(-1)
    draft_probs = torch.softmax(torch.randn(B, K, V, device="cuda", generator=gen) * 3, -1)
    # Drafts: the target's argmax half the time, so acceptance chains of every length occur.
    drafts = torch.where(torch.rand(B, K, device="cuda", generator=gen) < 0.5,
                         target_argmax[:, :K],
                         torch.randint(0, V, (B, K), device="cuda", generator=gen))
    uniforms = torch.rand(B, K, device="cuda", generator=gen)
    noise = torch.empty(B, V, device="cuda").exponential_(generator=gen)
    is_greedy = torch.rand(B, device="cuda", generator=gen) < 0.3
    res = {}
    for name, q in (("ngram", None), ("draft_model", draft_probs)):
        args = (drafts, num_drafts, target_argmax, target_probs, q, uniforms, noise, is_greedy)
        got = rejection_sample_triton(*args)
        want = rejection_sample_ref(*[a.cpu() if a is not None else None for a in args[:-1]],
                                    is_greedy.cpu())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            rejection_sample_triton(*args)
        torch.cuda.synchronize()
        res[name] = {"identical": bool((got.cpu() == want).all()),
                     "kernel_us": (time.perf_counter() - t0) / 10 * 1e6}
    return res


def main() -> None:
    attn = [attention_case(h, kv, dt) for h, kv in ((16, 8), (32, 8))
            for dt in (torch.bfloat16, torch.float16)]
    for a in attn:
        print(f"decode attention {a['heads']}/{a['kv_heads']} heads {a['dtype']}: max abs err "
              f"{a['max_abs_err']:.2e}, {a['kernel_us']:.0f} us", flush=True)
    pre = [prefill_case(h, kv, dt) for h, kv in ((16, 8), (32, 8))
           for dt in (torch.bfloat16, torch.float16)]
    for a in pre:
        print(f"prefill attention {a['heads']}/{a['kv_heads']} heads {a['dtype']}, {a['tokens']} "
              f"tokens: max abs err {a['max_abs_err']:.2e}, {a['kernel_us']:.0f} us "
              f"(torch loop {a['torch_loop_us']:.0f} us)", flush=True)
    splits = [split_case(n, dt) for n in (1, 4, 16) for dt in (torch.bfloat16, torch.float32)]
    for a in splits:
        print(f"decode attention, {a['num_splits']} splits, {a['dtype']}: max abs err "
              f"{a['max_abs_err']:.2e}, {a['kernel_us']:.0f} us", flush=True)
    ops = [layer_ops_case(dt) for dt in (torch.bfloat16, torch.float16, torch.float32)]
    for o in ops:
        print(f"layer ops {o['dtype']}: {o}", flush=True)
    shapes = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024), (1024, 151936),
              (4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
    skinny = [skinny_gemm_case(r, k, n) for r in (1, 8) for k, n in shapes]
    for a in skinny:
        print(f"skinny gemm {a['rows']} x {a['k']} -> {a['n']}: {a['skinny_us']:.1f} us "
              f"({a['skinny_GBps']:.0f} GB/s) vs torch {a['torch_us']:.1f} us; max abs err "
              f"{a['skinny_max_abs_err']:.2e} vs torch {a['torch_max_abs_err']:.2e}", flush=True)
    stage = stage_rope_tables_case()
    print(f"bf16 stage with rope tables against per-step cos/sin: {stage}", flush=True)
    rej = [rejection_case(s) for s in range(4)]
    for i, r in enumerate(rej):
        print(f"rejection sampler seed {i}: " + ", ".join(
            f"{k} identical={v['identical']} {v['kernel_us']:.0f} us" for k, v in r.items()), flush=True)
    ok = all(a["max_abs_err"] < 3e-2 for a in attn + pre + splits) and \
        all(a["max_abs_err"] < 1e-4 for a in splits if a["dtype"] == "torch.float32") and \
        all(o["write_kv"]["identical"] and o["qk_rope_kv"]["identical"] for o in ops) and \
        all(v["identical"] for r in rej for v in r.values()) and stage["identical"] and \
        all(a["skinny_max_abs_err"] <= 2 * a["torch_max_abs_err"] + 1e-2 for a in skinny)
    print("wrote", save("kernel_check_gpu", {"attention": attn, "prefill_attention": pre,
                                                "decode_splits": splits, "layer_ops": ops,
                                                "rejection_sampler": rej, "stage_rope_tables": stage,
                                                "skinny_gemm": skinny,
                                                "all_ok": ok}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
