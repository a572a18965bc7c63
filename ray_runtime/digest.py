"""The bookkeeping digest: a cheap fingerprint of one request's row on one rank.

token_hash(tokens) = sum(tokens[i] * W[i]) mod 2**64, with W a fixed table of random odd
64-bit weights. It is position-sensitive, any single changed token changes it (W[i] is odd),
the driver updates it in O(1) per appended token, and a rank recomputes it from the row's
actual contents (so a corrupted cell is seen) with one vectorized pass.
"""
from __future__ import annotations

import functools

import numpy as np

MASK64 = (1 << 64) - 1


def hash_weights(length: int) -> np.ndarray:
    """At least `length` uint64 weights; every table is a prefix of the next larger one,
    on every process (fixed seed, sizes in powers of two)."""
    return _table(max(10, (length - 1).bit_length()))


@functools.lru_cache(maxsize=None)
def _table(log2_size: int) -> np.ndarray:
    rng = np.random.default_rng(0x5EED_D16E57)
    return rng.integers(0, 2 ** 63, size=1 << log2_size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def extend_hash(h: int, start: int, tokens: list[int]) -> int:
    """The driver's incremental update: h over tokens[:start] -> over tokens[:start+len]."""
    w = hash_weights(start + len(tokens))
    for i, t in enumerate(tokens):
        h = (h + t * int(w[start + i])) & MASK64
    return h


def rows_hash(token_ids: np.ndarray, rows: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """A rank's view: the hash of token_ids[row, :length] for each (row, length)."""
    if len(rows) == 0:
        return np.zeros(0, np.uint64)
    width = int(lengths.max())
    w = hash_weights(width)[:width]
    block = token_ids[rows, :width].astype(np.uint64)
    block[np.arange(width)[None, :] >= lengths[:, None]] = 0
    with np.errstate(over="ignore"):
        return (block * w[None, :]).sum(axis=1, dtype=np.uint64)


def spans_hash_delta(token_ids: np.ndarray, rows: np.ndarray, start: np.ndarray,
                     end: np.ndarray) -> np.ndarray:
    """Per row, the sum of token_ids[row, i] * W[i] over i in [start, end) (mod 2**64): what
    moves a row's hash from length `start` to length `end` (start <= end). O(tokens in the
    spans): a decode step's span is one token."""
    n = end - start
    out = np.zeros(len(rows), np.uint64)
    longest = int(n.max()) if len(n) else 0
    if longest == 0:
        return out
    if longest == 1:  # a decode step: at most one token per span, no repeat/scatter
        one = np.nonzero(n)[0]
        pos = start[one]
        w = hash_weights(int(end.max()))
        with np.errstate(over="ignore"):
            out[one] = token_ids[rows[one], pos].astype(np.uint64) * w[pos]
        return out
    total = int(n.sum())
    which = np.repeat(np.arange(len(rows)), n)
    pos = np.arange(total) - np.repeat(np.cumsum(n) - n, n) + np.repeat(start, n)
    w = hash_weights(int(end.max()))
    with np.errstate(over="ignore"):
        terms = token_ids[rows[which], pos].astype(np.uint64) * w[pos]
    np.add.at(out, which, terms)
    return out
