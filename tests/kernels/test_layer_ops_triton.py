"""The fused layer kernels against their torch references, on CPU through Triton's
interpreter (TRITON_INTERPRET=1); bench/kernel_check.py runs the same comparisons on the GPU.

In float32 the kernels agree to summation order. In bfloat16 only closeness is checked here:
the interpreter truncates float32 -> bfloat16 where the GPU rounds to nearest even, so each
rounding point may be an ulp off. Bit-exact bf16 agreement with the unfused torch ops is
checked on the GPU (bench/kernel_check.py)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.layer_ops import rms_norm_ref, rope_ref  # noqa: E402
from kernels.layer_ops_triton import (  # noqa: E402
    norm_rope_triton_,
    rms_norm_triton,
    silu_and_mul_triton,
    write_kv_triton,
)
from kernels.paged_attention import write_kv_ref  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=4e-2, atol=4e-2)}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [64, 96, 1024])
def test_rms_norm(dtype, n):
    g = _gen(n)
    x = (torch.randn(5, n, generator=g) * 3).to(dtype)
    w = torch.randn(n, generator=g).to(dtype)
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_returns_norm_of_sum_and_sum(dtype):
    g = _gen(1)
    x, r = (torch.randn(7, 128, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(128, generator=g).to(dtype)
    out, s = rms_norm_triton(x, w, 1e-5, residual=r)
    torch.testing.assert_close(s, r + x, **TOL[dtype])
    if dtype == torch.float32:
        assert torch.equal(s, r + x)  # one add, one rounding
    torch.testing.assert_close(out, rms_norm_ref(r + x, w, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_norm_rope_in_place(dtype, with_norm, head_dim):
    g = _gen(head_dim)
    x = torch.randn(6, 3, head_dim, generator=g).to(dtype)
    w = torch.randn(head_dim, generator=g).to(dtype) if with_norm else None
    pos = torch.tensor([0, 1, 5, 17, 300, 4095]).float()
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat([pos[:, None] * inv[None]] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    want = rope_ref(rms_norm_ref(x, w, 1e-6) if with_norm else x, cos, sin)
    got = norm_rope_triton_(x.clone(), w, 1e-6, cos, sin)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    g = _gen(3)
    gate, up = (torch.randn(4, 3000, generator=g).to(dtype) * 4 for _ in range(2))
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(silu_and_mul_triton(gate, up), want, **TOL[dtype])


def test_write_kv_lands_at_the_slots_and_nowhere_else():
    g = _gen(4)
    kc, vc = torch.zeros(6, 4, 2, 16), torch.zeros(6, 4, 2, 16)
    k, v = torch.randn(5, 2, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    slots = torch.tensor([0, 3, 4, 22, 9])  # block edges, out of order
    want_k, want_v = kc.clone(), vc.clone()
    write_kv_ref(want_k, want_v, k, v, slots)
    write_kv_triton(kc, vc, k, v, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    # a strided view (k sliced out of a wider projection) is written the same
    wide = torch.randn(5, 4, 16, generator=g)
    kc2, want2 = torch.zeros(6, 4, 2, 16), torch.zeros(6, 4, 2, 16)
    write_kv_triton(kc2, torch.zeros_like(kc2), wide[:, 1:3], wide[:, 1:3], slots)
    write_kv_ref(want2, torch.zeros_like(want2), wide[:, 1:3].contiguous(), wide[:, 1:3].contiguous(), slots)
    assert torch.equal(kc2, want2)


def test_launchers_name_what_does_not_fit():
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(torch.zeros(2, 8), torch.zeros(4), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_triton(torch.zeros(2, 8), torch.zeros(8), 1e-6, residual=torch.zeros(3, 8))
    with pytest.raises(ValueError, match="cos/sin"):
        norm_rope_triton_(torch.zeros(2, 1, 8), None, 1e-6, torch.zeros(3, 8), torch.zeros(3, 8))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_triton(torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8), torch.zeros(3, 1, 8),
                        torch.zeros(3, 1, 8), torch.zeros(2, dtype=torch.long))


def test_empty_inputs_launch_nothing_and_return_empty():
    """A stage may run a step with no rows of a kind (an empty decode set): every launcher
    returns an empty result instead of launching a zero-size grid."""
    from kernels.decode_attention_triton import paged_decode_attention

    assert rms_norm_triton(torch.zeros(0, 8), torch.ones(8), 1e-6).shape == (0, 8)
    out, s = rms_norm_triton(torch.zeros(0, 8), torch.ones(8), 1e-6, residual=torch.zeros(0, 8))
    assert out.shape == s.shape == (0, 8)
    assert norm_rope_triton_(torch.zeros(0, 2, 8), None, 1e-6, torch.zeros(0, 8),
                             torch.zeros(0, 8)).shape == (0, 2, 8)
    assert silu_and_mul_triton(torch.zeros(0, 8), torch.zeros(0, 8)).shape == (0, 8)
    kc = torch.full((2, 4, 1, 16), 3.0)
    write_kv_triton(kc, kc.clone(), torch.zeros(0, 1, 16), torch.zeros(0, 1, 16),
                    torch.zeros(0, dtype=torch.long))
    assert (kc == 3.0).all()
    attn = paged_decode_attention(torch.zeros(0, 2, 16), kc, kc, torch.zeros(0, 2, dtype=torch.int32),
                                  torch.zeros(0, dtype=torch.int32), 0.25)
    assert attn.shape == (0, 2, 16)


def test_write_kv_takes_strided_slots_and_empty_strided_keys():
    """Found in review: a slot_mapping that is a strided view was read as if packed, and an
    empty strided key could not be reshaped."""
    g = _gen(6)
    slots = torch.tensor([[3, 99], [0, 99], [17, 99], [9, 99]])[:, 0]  # 99: out of range
    k, v = torch.randn(4, 2, 16, generator=g), torch.randn(4, 2, 16, generator=g)
    kc, vc = torch.zeros(6, 4, 2, 16), torch.zeros(6, 4, 2, 16)
    want_k, want_v = kc.clone(), vc.clone()
    write_kv_ref(want_k, want_v, k, v, slots.contiguous())
    write_kv_triton(kc, vc, k, v, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    empty = torch.randn(0, 2, 32)[:, :, :16]
    write_kv_triton(kc, vc, empty, empty, torch.zeros(0, dtype=torch.long))
    assert torch.equal(kc, want_k)


def test_decode_attention_takes_strided_seq_lens():
    from kernels.decode_attention_triton import paged_decode_attention
    from kernels.paged_attention import paged_attention_ref
    from tests.kernels.paged_kv import random_paged_kv

    g = _gen(7)
    lens = [5, 40, 17]
    tables, kc, vc = random_paged_kv(lens, num_kv_heads=1, head_dim=16, block_size=4, gen=g,
                                     table_dtype=torch.int32)
    q = torch.randn(3, 2, 16, generator=g)
    strided = torch.tensor([[5, 0], [40, 0], [17, 0]], dtype=torch.int32)[:, 0]
    got = paged_decode_attention(q, kc, vc, tables, strided, 0.25)
    want = paged_attention_ref(q, kc, vc, tables.long(), lens, [0, 1, 2, 3], 0.25)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
