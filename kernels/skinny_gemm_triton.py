"""A linear layer for a handful of rows (a decode step of few requests): y = x @ w.T (+ b)
for x [rows <= SKINNY_MAX_ROWS, K] and w [N, K], half precision on CUDA.

At one to eight rows a decoder layer's GEMMs read their weights once and do almost no math,
so they are bound by how fast the weights stream in. The library kernels chosen at that size
left the bandwidth mostly unused (a 1-row decode step of Qwen3-0.6B on an H200: 0.88 ms of
its ~1.2 ms of kernels in four GEMMs per layer, the weights worth 0.25 ms at the copy
bandwidth). Here each program owns BLOCK_N output columns for all the rows and streams their
weight rows along K, several tiles in flight; the rows, padded to 16, go through the tensor
cores with float32 accumulation, and the result is rounded to the model's dtype once.

Measured on an H200 (bench/kernel_check.py), this kernel beats the library's at some shapes
and loses at most (a 1-row 2048 -> 1024 projection: 5.0 against 12.4 us; a 1-row 1024 ->
6144 one: 5.9 against 5.0). So `faster_at` times both once per shape on the device, each in
a CUDA graph (so launch costs do not count), and a linear layer takes whichever was faster.
Shapes are timed only in the decode graphs' warm-up (timing_window): an eager step of few
rows, or the memory profile, takes the library's kernel rather than time mid-run.
The timing cycles through copies of the weight that together overflow the L2 cache: in a
decode step each weight streams in from memory, and a weight timed hot in L2 had the skinny
kernel chosen at 8 rows where the step then ran 2-3% slower. Timed cold, the choice made the
1-request decode step 12% faster (1.23-1.27 against 1.43 ms, Qwen3-0.6B shape on an H200)
and left 8, 64 and 256 requests within noise (docs/benchmarks.md). On by default;
RAY_RUNTIME_SKINNY_GEMM=0 turns it off (kernels/layer_ops.py).

Numerics: a float32 sum in another order than the library's, rounded once, as a bf16 GEMM
is; not bit-identical to it (only a bf16/fp16 model on CUDA takes this path; float32, the
exactness mode, never does). Oracle: torch's matmul (tests/kernels/test_skinny_gemm.py,
under TRITON_INTERPRET=1; bench/kernel_check.py on the GPU).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

SKINNY_MAX_ROWS = 8  # up to this many rows a linear layer takes this kernel on CUDA
_BLOCK_M = 16  # the rows, padded to what a tensor-core dot takes


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
                        stride_om, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# (device, rows, n, k, dtype, bias?) -> the skinny kernel was faster
_faster: dict[tuple, bool] = {}
_timing = False  # inside timing_window(): an untimed shape may be timed


@contextlib.contextmanager
def timing_window():
    """Where faster_at may time a shape it has not seen: a stage's decode-graph warm-up
    (stages/cuda_graphs.py), before the graphs are captured. Anywhere else (the memory
    profile, serving) an untimed shape takes the library's kernel, untimed: timing
    synchronizes, and its copies of a weight would count in the memory profile's peak. The
    copies' memory goes back to the device when the window closes."""
    global _timing
    was, _timing = _timing, True
    try:
        yield
    finally:
        _timing = was
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def faster_at(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              timer=None) -> bool:
    """Whether skinny_linear beat torch's linear at this shape on this device: timed the
    first time the shape comes inside timing_window() (never while a graph is being
    captured); outside it, or if the timing fails, torch's kernel.
    timer(fn, weight) -> seconds per call of fn(w) for w like weight (default: replayed in
    a CUDA graph over copies of weight that overflow the L2 cache, _graph_time)."""
    key = (x.device, x.shape[0], weight.shape[0], weight.shape[1], x.dtype, bias is not None)
    known = _faster.get(key)
    if known is not None:
        return known
    if not _timing or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return False
    if timer is None and not x.is_cuda:  # nothing to time on (the CPU interpreter)
        return False
    timer = timer or _graph_time
    try:
        _faster[key] = timer(lambda w: skinny_linear(x, w, bias), weight) < \
            timer(lambda w: torch.nn.functional.linear(x, w, bias), weight)
    except (torch.cuda.OutOfMemoryError, RuntimeError):  # no room for the copies, or a
        _faster[key] = False  # capture that failed: the library's kernel
    return _faster[key]


def cold_copies(weight: torch.Tensor, max_copies: int = 64) -> list[torch.Tensor]:
    """Copies of weight that together span twice the device's L2 cache (at most max_copies,
    at least two), so that cycling through them reads each from memory, as a decode step
    does."""
    l2 = getattr(torch.cuda.get_device_properties(weight.device), "L2_cache_size", 0) or (64 << 20)
    nbytes = max(1, weight.numel() * weight.element_size())
    count = max(2, min(max_copies, -(-2 * l2 // nbytes)))
    return [weight.clone() for _ in range(count)]


def _graph_time(fn, weight: torch.Tensor, reps: int = 3) -> float:
    """Seconds per call of fn(w), from a CUDA graph of one call per copy of weight
    (cold_copies) replayed `reps` times."""
    copies = cold_copies(weight)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(weight)  # compiled, workspaces made
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA call (NCCL's watchdog) must not void the capture
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            for w in copies:
                fn(w)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
    torch.cuda.current_stream().wait_stream(stream)
    return start.elapsed_time(end) / 1e3 / (len(copies) * reps)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, K] (rows <= SKINNY_MAX_ROWS) @ weight [N, K].T (+ bias [N]) -> [rows, N]."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         "must be [rows, K] and [N, K]")
    rows, k = x.shape
    n = weight.shape[0]
    if rows > SKINNY_MAX_ROWS:
        raise ValueError(f"skinny_linear: {rows} rows, at most {SKINNY_MAX_ROWS}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("skinny_linear: x and weight must be contiguous along K")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"skinny_linear: bias {tuple(bias.shape)} must be [{n}]")
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        block_n = 16
        _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
            x, weight, bias if bias is not None else weight, out, rows, n, k, x.stride(0),
            weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=_BLOCK_M,
            BLOCK_N=block_n, BLOCK_K=min(256, triton.next_power_of_2(k)), num_warps=4,
            num_stages=4)
    return out
