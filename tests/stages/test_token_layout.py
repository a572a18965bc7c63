"""The step's token layout (stages/model.py: token_layout, kernels/paged_attention.py:
decode_layout_arrays): a decode step's shortcut (one token per row) gives what the general
computation gives, for every row order and context; mixed steps take the general path."""
import numpy as np
import pytest

from kernels.paged_attention import decode_layout_arrays
from stages.model import token_layout


def _general_layout(rows, starts, num_new):
    qsl = np.concatenate([[0], np.cumsum(num_new)])
    token_row = np.repeat(rows, num_new)
    positions = np.arange(qsl[-1]) - np.repeat(qsl[:-1], num_new) + np.repeat(starts, num_new)
    return qsl, token_row, positions


def _general_decode_arrays(ctx, qsl, short_chunk=8):
    n = np.diff(qsl)
    req = np.repeat(np.arange(len(n)), n)
    position = np.arange(qsl[-1]) - qsl[:-1][req] + (ctx - n)[req]
    decode = (n <= short_chunk)[req]
    return np.nonzero(decode)[0], req[decode], position[decode] + 1


@pytest.mark.parametrize("seed", range(20))
def test_decode_shortcut_equals_the_general_layout(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    rows = rng.permutation(64)[:n].astype(np.int64)
    starts = rng.integers(0, 500, n).astype(np.int64)
    ones = np.ones(n, np.int64)
    for got, want in zip(token_layout(rows, starts, ones), _general_layout(rows, starts, ones)):
        assert got.tolist() == want.tolist()
    qsl, _, _ = token_layout(rows, starts, ones)
    ctx = starts + 1
    token_rows, table_rows, ctx_lens, long_chunks, all_decode = decode_layout_arrays(ctx, qsl)
    for got, want in zip((token_rows, table_rows, ctx_lens), _general_decode_arrays(ctx, qsl)):
        assert got.tolist() == want.tolist()
    assert long_chunks == [] and all_decode


def test_mixed_steps_take_the_general_path():
    rows, starts = np.array([5, 2, 7]), np.array([10, 0, 3])
    num_new = np.array([1, 3, 1])
    for got, want in zip(token_layout(rows, starts, num_new), _general_layout(rows, starts, num_new)):
        assert got.tolist() == want.tolist()
    qsl = np.array([0, 1, 4, 5])
    ctx = starts + num_new
    got = decode_layout_arrays(ctx, qsl)
    assert got[0].tolist() == [0, 1, 2, 3, 4] and got[1].tolist() == [0, 1, 1, 1, 2]
    assert got[2].tolist() == [11, 1, 2, 3, 4] and got[3] == [] and not got[4]
