"""stages/seeded_noise.py: counter-based Exp(1) noise for seeded draws. Its bits equal exact
integer SplitMix64, every bit pattern gives a positive E, neighbouring seeds and indices get
unrelated streams, and chunking does not change the numbers."""
from __future__ import annotations

import torch

CPU = torch.device("cpu")


def test_seeded_noise_bits_equal_exact_splitmix64():
    from stages.seeded_noise import GOLDEN, mix64, request_key, uniform_bits

    keys = [request_key(s, i) for s, i in [(0, 0), (1, 0), (0, 1), (-5, 3), (2 ** 62, 7),
                                           (-(2 ** 63), 2 ** 40)]]
    bits = uniform_bits(keys, 3000, CPU)
    for r, key in enumerate(keys):
        for t in (0, 1, 2, 1499, 2999):
            assert int(bits[r, t]) == mix64(key + t * GOLDEN) >> 41, (r, t)
    assert bits.min() >= 0 and bits.max() < 2 ** 23


def test_seeded_noise_is_exp1_and_keys_do_not_share_streams():
    from stages.seeded_noise import exponentials, request_key

    # neighbouring seeds and indices: key(s, i + 1) and key(s + 1, i) are unrelated streams
    keys = [request_key(s, i) for s in range(4) for i in range(4)]
    e = exponentials(keys, 20000, CPU).double()
    assert e.min() > 0
    assert abs(e.mean().item() - 1.0) < 0.01 and abs(e.var().item() - 1.0) < 0.03
    flat = e - e.mean(dim=1, keepdim=True)
    corr = (flat @ flat.T) / (flat.norm(dim=1)[:, None] * flat.norm(dim=1)[None, :])
    off = corr[~torch.eye(len(keys), dtype=torch.bool)]
    assert off.abs().max() < 0.05
    # nor a stream shifted by a token (what seed * GOLDEN + t * GOLDEN would give)
    shifted = torch.corrcoef(torch.stack([e[0, 1:], e[4, :-1]]))[0, 1]
    assert abs(shifted.item()) < 0.05


def test_seeded_noise_chunks_agree_with_one_pass(monkeypatch):
    import stages.seeded_noise as sn

    keys = [sn.request_key(7, i) for i in range(9)]
    whole = sn.exponentials(keys, 500, CPU)
    monkeypatch.setattr(sn, "_CHUNK_ELEMENTS", 1000)  # 2 rows a chunk
    assert torch.equal(sn.exponentials(keys, 500, CPU), whole)


def test_every_noise_bit_pattern_gives_a_positive_finite_exponential():
    """All 2^23 patterns: u never rounds to 1 (E = 0 would let any token win the race)."""
    from stages.seeded_noise import UNIFORM_BITS, bits_to_exponential

    e = bits_to_exponential(torch.arange(2 ** UNIFORM_BITS, dtype=torch.long))
    assert e.min() > 0 and torch.isfinite(e).all()
    assert e.min() > 2.0 ** -25 and e.max() < 17  # E of u = 1 - 2^-24 and of u = 2^-24
    assert torch.unique(e).numel() > 0.99 * 2 ** UNIFORM_BITS  # no merged patterns to speak of
