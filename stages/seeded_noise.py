"""Counter-based random numbers for seeded sampling: the Exp(1) noise of the exponential race
for a seeded request's draw at output index i is a pure function of (seed, i, token id), so
it needs no per-request generator and every seeded row of a step is drawn in one batch.

The numbers are SplitMix64's: a request's key = mix(seed * GOLDEN + i) (on the host, exact
64-bit arithmetic; the mix keeps the keys of neighbouring seeds and indices apart), and the
token t's 64 bits = mix(key + t * GOLDEN), the t-th output of a SplitMix64 stream seeded
with the key. The top 23 bits make a uniform u = (bits + 0.5) / 2^23 in [2^-24, 1 - 2^-24]
(exact in float32: with 24 bits, bits + 0.5 rounds and the top pattern gives u = 1, E = 0, a
token that wins any race), and E = -log(u) >= ~2^-24, the floor of torch's CUDA
exponential_. On the device the arithmetic is int64 with wrap-around (what two's-complement
multiplication gives); a test holds the device's bits to Python's exact integers.
"""
from __future__ import annotations

import numpy as np
import torch

from stages.staging import to_device_async

GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_U64 = (1 << 64) - 1
UNIFORM_BITS = 23
# Rows per chunk: the int64 work buffers of a chunk stay near 3 x 32 MiB at any vocabulary.
_CHUNK_ELEMENTS = 1 << 22


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= (1 << 63) else v


def mix64(x: int) -> int:
    """SplitMix64's output function on a Python int (exact, mod 2^64)."""
    x &= _U64
    x = ((x ^ (x >> 30)) * _M1) & _U64
    x = ((x ^ (x >> 27)) * _M2) & _U64
    return x ^ (x >> 31)


def request_key(seed: int, output_index: int) -> int:
    """The key of a seeded request's draw at output_index, as a signed int64."""
    return _signed(mix64(seed * GOLDEN + output_index))


def _lshr(x: torch.Tensor, k: int) -> torch.Tensor:
    """x >> k as an unsigned 64-bit shift (torch's >> on int64 keeps the sign)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix64_(x: torch.Tensor) -> torch.Tensor:
    x ^= _lshr(x, 30)
    x *= _signed(_M1)
    x ^= _lshr(x, 27)
    x *= _signed(_M2)
    x ^= _lshr(x, 31)
    return x


def uniform_bits(keys: list[int], vocab: int, device) -> torch.Tensor:
    """[len(keys), vocab] int64 in [0, 2^23): token t's bits for each key (request_key)."""
    return _fill(torch.long, keys, vocab, device, lambda bits: bits)


def exponentials(keys: list[int], vocab: int, device) -> torch.Tensor:
    """[len(keys), vocab] float32 Exp(1) noise, the exponential race's E for each seeded row:
    bits_to_exponential of uniform_bits, computed in chunks."""
    return _fill(torch.float32, keys, vocab, device, bits_to_exponential)


def bits_to_exponential(bits: torch.Tensor) -> torch.Tensor:
    """int64 bits in [0, 2^23) -> float32 E = -log((bits + 0.5) / 2^23), > 0 for every bits."""
    u = bits.to(torch.float32).add_(0.5).mul_(2.0 ** -UNIFORM_BITS)
    return u.log_().neg_()


def _fill(dtype: torch.dtype, keys: list[int], vocab: int, device, convert) -> torch.Tensor:
    """[len(keys), vocab] of `dtype`: convert(the top UNIFORM_BITS of each token's 64 bits),
    a chunk of rows at a time."""
    out = torch.empty((len(keys), vocab), dtype=dtype, device=device)
    rows = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    key_t = to_device_async(np.asarray(keys, np.int64), device)
    steps = torch.arange(vocab, dtype=torch.long, device=device) * _signed(GOLDEN)
    for start in range(0, len(keys), rows):
        z = key_t[start:start + rows, None] + steps[None, :]
        out[start:start + rows] = convert(_lshr(_mix64_(z), 64 - UNIFORM_BITS))
    return out
