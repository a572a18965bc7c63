"""The Triton prefill (chunk) attention kernel against the torch reference, on CPU through
Triton's interpreter (TRITON_INTERPRET=1); on the GPU, bench/kernel_check.py."""
import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.paged_attention import paged_attention_ref  # noqa: E402
from kernels.prefill_attention_triton import prefill_attention  # noqa: E402
from tests.kernels.paged_kv import random_paged_kv  # noqa: E402


def _case(reqs, *, group, head_dim, block_size, num_kv_heads=2, block_m=8, only=None, seed=0):
    """reqs: (context length, chunk length) per request; `only`: the requests the kernel runs
    (the others' rows must stay untouched)."""
    gen = torch.Generator().manual_seed(seed)
    tables, kc, vc = random_paged_kv([c for c, _ in reqs], num_kv_heads=num_kv_heads,
                                     head_dim=head_dim, block_size=block_size, gen=gen,
                                     table_dtype=torch.int64)
    qsl = [0]
    for _, n in reqs:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], num_kv_heads * group, head_dim, generator=gen)
    scale = 1.0 / math.sqrt(head_dim)
    seq_lens = [c for c, _ in reqs]
    run = list(range(len(reqs))) if only is None else only
    out = torch.full_like(q, 7.0)
    prefill_attention(q, kc, vc, tables, seq_lens, qsl, run, out, scale, block_m=block_m)
    ref = paged_attention_ref(q, kc, vc, tables, seq_lens, qsl, scale)
    for i in range(len(reqs)):
        a, b = qsl[i], qsl[i + 1]
        if i in run:
            torch.testing.assert_close(out[a:b], ref[a:b], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"request {i} {reqs[i]}: {m}")
        else:
            assert (out[a:b] == 7.0).all(), f"request {i} was not to be touched"


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim,block_size", [(16, 4), (64, 16)])
def test_chunks_over_cached_prefixes(group, head_dim, block_size):
    # whole prompts, chunks after a prefix, a chunk ending on a block edge, tiles that do
    # not divide the chunk, a one-token chunk
    reqs = [(37, 11), (13, 13), (3 * block_size, block_size + 1), (40, 17), (5, 1),
            (2 * block_size, 2 * block_size)]
    _case(reqs, group=group, head_dim=head_dim, block_size=block_size, seed=group + head_dim)


def test_only_listed_requests_are_written():
    _case([(20, 20), (9, 1), (30, 12)], group=2, head_dim=16, block_size=4, only=[0, 2])


def test_launcher_rejects_bad_shapes():
    q = torch.zeros(4, 4, 16)
    kc = torch.zeros(3, 4, 2, 32)
    with pytest.raises(ValueError, match="head_dim"):
        prefill_attention(q, kc, kc, torch.zeros(1, 3, dtype=torch.long), [4], [0, 4], [0],
                          torch.empty_like(q), 0.25)
    kc = torch.zeros(3, 4, 3, 16)
    with pytest.raises(ValueError, match="kv heads"):
        prefill_attention(q, kc, kc, torch.zeros(1, 3, dtype=torch.long), [4], [0, 4], [0],
                          torch.empty_like(q), 0.25)
    kc = torch.zeros(3, 4, 2, 16)
    with pytest.raises(ValueError, match="chunk of 4 tokens in a context of 3"):
        prefill_attention(q, kc, kc, torch.zeros(1, 3, dtype=torch.long), [3], [0, 4], [0],
                          torch.empty_like(q), 0.25)


def test_staged_tiles_cover_each_chunk_once_and_match_the_launcher():
    """A step stages prefill_tile_arrays() with its inputs (no copy per layer): the tiles
    cover every query row of every listed chunk exactly once, and the kernel fed them writes
    what it writes when it builds them itself."""
    import numpy as np

    from kernels.paged_attention import PREFILL_BLOCK_M, prefill_tile_arrays

    reqs = [(100, 70), (9, 1), (64, 64), (40, 33)]
    qsl = np.concatenate([[0], np.cumsum([n for _, n in reqs])])
    run = [0, 2, 3]
    tile_req, tile_m0, q_start, q_len, ctx = prefill_tile_arrays(
        [c for c, _ in reqs], qsl, run)
    covered = sorted((int(r), int(m0) + j) for r, m0 in zip(tile_req, tile_m0)
                     for j in range(PREFILL_BLOCK_M) if m0 + j < q_len[r])
    assert covered == [(r, j) for r in run for j in range(reqs[r][1])]
    assert q_start.tolist() == qsl[:-1].tolist() and ctx.tolist() == [c for c, _ in reqs]

    gen = torch.Generator().manual_seed(3)
    tables, kc, vc = random_paged_kv([c for c, _ in reqs], num_kv_heads=2, head_dim=16,
                                     block_size=4, gen=gen, table_dtype=torch.int64)
    q = torch.randn(int(qsl[-1]), 4, 16, generator=gen)
    seq_lens = [c for c, _ in reqs]
    built, staged = torch.zeros_like(q), torch.zeros_like(q)
    prefill_attention(q, kc, vc, tables, seq_lens, qsl.tolist(), run, built, 0.25)
    tiles = tuple(torch.from_numpy(a) for a in prefill_tile_arrays(seq_lens, qsl, run))
    prefill_attention(q, kc, vc, tables, seq_lens, qsl.tolist(), run, staged, 0.25, tiles=tiles)
    assert torch.equal(built, staged) and built.abs().sum() > 0
