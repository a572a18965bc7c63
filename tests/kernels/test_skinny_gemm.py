"""The skinny GEMM (a linear layer for a handful of rows) against torch's matmul, on CPU
through Triton's interpreter; bench/kernel_check.py runs it at real shapes on the GPU."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.skinny_gemm_triton import SKINNY_MAX_ROWS, skinny_linear  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,n,k", [(1, 64, 256), (3, 50, 300), (SKINNY_MAX_ROWS, 40, 520)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_matmul(dtype, rows, n, k, with_bias):
    """Ragged N and K (masked tails, K over one tile), every row count up to the limit."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if with_bias else None
    want = x.double() @ w.double().T + (b.double() if with_bias else 0)
    got = skinny_linear(x, w, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_rows_of_a_wider_tensor_and_no_rows():
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(4, 96, generator=g)
    x = wide[:, :64]  # row stride 96: a view, as a slice of a fused projection is
    w = torch.randn(32, 64, generator=g)
    torch.testing.assert_close(skinny_linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    assert skinny_linear(torch.zeros(0, 64), w).shape == (0, 32)


def test_names_what_does_not_fit():
    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="rows"):
        skinny_linear(torch.zeros(SKINNY_MAX_ROWS + 1, 16), w)
    with pytest.raises(ValueError, match=r"\[rows, K\]"):
        skinny_linear(torch.zeros(2, 15), w)
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(torch.zeros(2, 16), w, torch.zeros(7))
    with pytest.raises(ValueError, match="contiguous"):
        skinny_linear(torch.zeros(16, 2).T, w)


def test_linear_takes_the_kernel_for_few_half_precision_rows_only(monkeypatch):
    """kernels.layer_ops.linear: the skinny kernel where the fused kernels run (half precision
    on CUDA; forced here), rows <= SKINNY_MAX_ROWS and it was timed faster, by default and
    with RAY_RUNTIME_SKINNY_GEMM=1; the module itself otherwise, with =0, and on the float32
    exactness path always."""
    import kernels.layer_ops as layer_ops
    import kernels.skinny_gemm_triton as skinny

    calls = []
    real = skinny.skinny_linear
    monkeypatch.setattr(skinny, "skinny_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    layer = torch.nn.Linear(32, 24, bias=True).to(torch.float16)
    x = torch.randn(SKINNY_MAX_ROWS + 4, 32).to(torch.float16)
    monkeypatch.setenv(layer_ops.SKINNY_GEMM_ENV, "1")
    layer_ops.linear(x[:2], layer)  # on CPU: the module
    assert calls == []
    monkeypatch.setattr(layer_ops, "_fused", lambda t: True)
    monkeypatch.setattr(skinny, "faster_at", lambda x, w, b: x.shape[0] != 3)  # timed slower at 3
    layer_ops.linear(x[:3], layer)
    assert calls == []
    for rows in (1, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 4):
        got = layer_ops.linear(x[:rows], layer)
        torch.testing.assert_close(got.float(), layer(x[:rows]).float(), rtol=2e-3, atol=2e-3)
    assert calls == [1, SKINNY_MAX_ROWS]
    monkeypatch.setenv(layer_ops.SKINNY_GEMM_ENV, "0")
    layer_ops.linear(x[:1], layer)
    assert calls == [1, SKINNY_MAX_ROWS]
    monkeypatch.delenv(layer_ops.SKINNY_GEMM_ENV)  # on by default
    layer_ops.linear(x[:1], layer)
    assert calls == [1, SKINNY_MAX_ROWS, 1]


def test_faster_at_times_each_shape_once_and_never_while_capturing(monkeypatch):
    import kernels.skinny_gemm_triton as skinny

    monkeypatch.setattr(skinny, "_faster", {})
    timed = []

    def timer(fn, weight):  # the skinny kernel is timed first: call it "slower" at 2 rows
        assert weight is w
        timed.append(fn)
        return 1.0 if len(timed) % 2 else (0.5 if timed_rows[-1] == 2 else 2.0)

    w = torch.zeros(16, 32)
    timed_rows = [1]
    # outside the warm-up's window: the library's kernel, nothing timed or kept
    assert skinny.faster_at(torch.zeros(1, 32), w, None, timer) is False
    assert timed == [] and skinny._faster == {}
    monkeypatch.setattr(skinny, "_timing", True)  # inside timing_window()
    assert skinny.faster_at(torch.zeros(1, 32), w, None, timer) is True
    assert skinny.faster_at(torch.zeros(1, 32), w, None, timer) is True and len(timed) == 2
    timed_rows.append(2)
    assert skinny.faster_at(torch.zeros(2, 32), w, None, timer) is False and len(timed) == 4
    # a shape first seen inside a graph capture: torch's kernel, and nothing timed or kept
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert skinny.faster_at(torch.zeros(4, 32), w, None, timer) is False and len(timed) == 4
    assert not any(key[1] == 4 for key in skinny._faster)
    # a timing that fails (a capture voided, no memory for the copies): the library's kernel

    def failing(fn, weight):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert skinny.faster_at(torch.zeros(5, 32), w, None, failing) is False


def test_timing_window_opens_and_closes(monkeypatch):
    import kernels.skinny_gemm_triton as skinny

    assert skinny._timing is False
    with skinny.timing_window():
        assert skinny._timing is True
        with skinny.timing_window():
            assert skinny._timing is True
        assert skinny._timing is True
    assert skinny._timing is False


def test_the_timing_copies_overflow_the_l2_cache(monkeypatch):
    # a weight timed hot in L2 made the skinny kernel look faster at 8 rows than it runs in
    # a decode step, where every weight streams in from memory
    import types

    import kernels.skinny_gemm_triton as skinny

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(L2_cache_size=1 << 20))
    small = torch.zeros(128, 128)  # 64 KiB: 32 copies span 2 MiB
    copies = skinny.cold_copies(small)
    assert len(copies) == 32 and all(c.data_ptr() != small.data_ptr() for c in copies)
    assert len({c.data_ptr() for c in copies}) == 32
    assert len(skinny.cold_copies(torch.zeros(1024, 1024))) == 2  # 4 MiB: at least two
    assert len(skinny.cold_copies(torch.zeros(8, 8))) == 64  # capped


def test_faster_at_without_a_device_takes_the_library_kernel(monkeypatch):
    # on by default, the choice must not try to time CUDA graphs where there is no GPU (the
    # fused path forced on the CPU interpreter)
    import kernels.skinny_gemm_triton as skinny

    monkeypatch.setattr(skinny, "_faster", {})
    with skinny.timing_window():
        assert skinny.faster_at(torch.zeros(2, 32), torch.zeros(16, 32), None) is False
    assert skinny._faster == {}
