"""stages/sampler.py (Sampler, apply_filters, seeded_generator) and SamplingParams validation."""
from __future__ import annotations

import math

import pytest
import torch

from ray_runtime.sampling_params import SamplingParams
from stages.sampler import Sampler, apply_filters, seeded_generator

CPU = torch.device("cpu")


@pytest.fixture
def sampler() -> Sampler:
    return Sampler(CPU)


def _logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _kept(logits: torch.Tensor) -> list[bool]:
    return torch.isfinite(logits).tolist()


# ---- greedy and top-k --------------------------------------------------------------------

def test_greedy_is_argmax(sampler):
    logits = _logits(16, 50, seed=0)
    res = sampler(logits, [SamplingParams(temperature=0.0)] * 16, [0] * 16)
    assert res.token_ids == torch.argmax(logits, dim=-1).tolist()
    assert not res.any_logprobs
    assert res.logprobs == [[]] * 16 and res.ranks == [0] * 16


def test_greedy_ignores_seed_and_filters(sampler):
    logits = _logits(8, 50, seed=1)
    params = [SamplingParams(temperature=0.0, seed=s, top_p=0.3, top_k=5, min_p=0.2)
              for s in range(8)]
    assert sampler(logits, params, list(range(8))).token_ids == \
        torch.argmax(logits, dim=-1).tolist()


@pytest.mark.parametrize("seeded", [False, True])
def test_top_k_1_is_argmax_at_high_temperature(sampler, seeded):
    logits = _logits(32, 100, seed=2, scale=0.5)  # nearly flat, and T=100 flattens more
    expected = torch.argmax(logits, dim=-1).tolist()
    for trial in range(5):
        params = [SamplingParams(temperature=100.0, top_k=1, seed=(i if seeded else None))
                  for i in range(32)]
        assert sampler(logits, params, [trial] * 32).token_ids == expected


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5, 0.7, 3.0])
    out = apply_filters(logits, SamplingParams(top_k=3))
    assert _kept(out) == [False, True, False, True, False, True]
    for disabled in (0, -1, 6, 100):
        assert all(_kept(apply_filters(logits, SamplingParams(top_k=disabled))))


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, -2.0, 4.0])
    assert torch.allclose(apply_filters(logits, SamplingParams(temperature=0.5)), logits * 2)


# ---- top-p and min-p ---------------------------------------------------------------------

PROBS = [0.5, 0.3, 0.15, 0.05]


@pytest.mark.parametrize("top_p,kept", [
    (0.8, [True, True, False, False]),   # 0.5 + 0.3 reaches 0.8 exactly: the first two
    (0.7, [True, True, False, False]),
    (0.81, [True, True, True, False]),
    (0.4, [True, False, False, False]),  # the top token always stays
    (0.05, [True, False, False, False]),
    (0.97, [True, True, True, True]),
    (1.0, [True, True, True, True]),
])
def test_top_p_keeps_smallest_prefix_reaching_top_p(top_p, kept):
    logits = torch.tensor(PROBS).log()
    assert _kept(apply_filters(logits, SamplingParams(top_p=top_p))) == kept
    # Order in the vocabulary does not matter: the same tokens, permuted.
    perm = torch.tensor([2, 0, 3, 1])
    out = apply_filters(logits[perm], SamplingParams(top_p=top_p))
    assert _kept(out) == [kept[j] for j in perm.tolist()]


@pytest.mark.parametrize("probs,top_p,kept", [
    # Dyadic probabilities: the mass before each token is exact in float32, so these pin
    # down "reaching" top_p (>=), not just "exceeding" it.
    ([0.5, 0.25, 0.125, 0.125], 0.75, [True, True, False, False]),
    ([0.5, 0.25, 0.125, 0.125], 0.5, [True, False, False, False]),
    ([0.5, 0.25, 0.125, 0.125], 0.875, [True, True, True, False]),
    ([0.25, 0.5, 0.125, 0.125], 0.75, [True, True, False, False]),
])
def test_top_p_exact_boundaries(probs, top_p, kept):
    out = apply_filters(torch.tensor(probs).log(), SamplingParams(top_p=top_p))
    assert _kept(out) == kept


def test_top_p_filtered_tokens_are_never_sampled(sampler):
    logits = torch.tensor(PROBS).log().repeat(200, 1)
    params = [SamplingParams(top_p=0.8, seed=s) for s in range(200)]
    toks = sampler(logits, params, [0] * 200).token_ids
    assert set(toks) == {0, 1}


@pytest.mark.parametrize("min_p,kept", [
    (0.2, [True, True, True, False]),    # threshold 0.1
    (0.5, [True, True, False, False]),   # threshold 0.25
    (0.7, [True, False, False, False]),  # threshold 0.35
    (0.0, [True, True, True, True]),
    (1.0, [True, False, False, False]),
])
def test_min_p_drops_tokens_below_fraction_of_max(min_p, kept):
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()
    order = [1, 3, 0, 2]  # vocabulary ids by probability
    out = apply_filters(logits, SamplingParams(min_p=min_p))
    by_prob = [_kept(out)[j] for j in order]
    assert by_prob == kept


def test_filters_compose_top_k_then_top_p():
    # top_k=3 renormalises [0.5, 0.3, 0.15] -> [0.526, 0.316, 0.158]; top_p=0.8 then keeps 2.
    logits = torch.tensor(PROBS).log()
    out = apply_filters(logits, SamplingParams(top_k=3, top_p=0.8))
    assert _kept(out) == [True, True, False, False]


# ---- seeds -------------------------------------------------------------------------------

def test_seeded_generator_is_deterministic():
    a = torch.rand(8, generator=seeded_generator(123, 4, CPU))
    b = torch.rand(8, generator=seeded_generator(123, 4, CPU))
    c = torch.rand(8, generator=seeded_generator(123, 5, CPU))
    d = torch.rand(8, generator=seeded_generator(124, 4, CPU))
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d)


def test_same_seed_and_index_gives_same_token_regardless_of_batch():
    vocab = 200
    row = _logits(1, vocab, seed=3, scale=0.3)[0]  # nearly flat: draws are informative
    sp = SamplingParams(temperature=1.0, seed=77)
    alone = Sampler(CPU)(row[None], [sp], [5]).token_ids[0]
    others = _logits(7, vocab, seed=4)
    for pos in range(8):
        batch = torch.cat([others[:pos], row[None], others[pos:]])
        params = [SamplingParams(temperature=0.7, seed=1000 + i) if i % 2 else
                  SamplingParams(temperature=1.3) for i in range(7)]
        params.insert(pos, sp)
        indices = [i * 3 for i in range(7)]
        indices.insert(pos, 5)
        res = Sampler(CPU)(batch, params, indices)
        assert res.token_ids[pos] == alone, pos
    # The unseeded rows' draws in between do not move the seeded row either.
    s = Sampler(CPU)
    for _ in range(3):
        s(others, [SamplingParams()] * 7, [0] * 7)
    assert s(row[None], [sp], [5]).token_ids[0] == alone


def test_different_output_indices_give_different_draws(sampler):
    vocab = 1000
    logits = torch.zeros(1, vocab)  # uniform
    sp = SamplingParams(seed=42)
    draws = [sampler(logits, [sp], [i]).token_ids[0] for i in range(64)]
    # 64 uniform draws from 1000: about 2 collisions expected; all-equal means a fixed stream.
    assert len(set(draws)) >= 50
    # And different seeds at the same index differ too.
    per_seed = [sampler(logits, [SamplingParams(seed=s)], [0]).token_ids[0] for s in range(64)]
    assert len(set(per_seed)) >= 50


def test_seeded_empirical_distribution_matches_softmax():
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -2.0]])
    probs = torch.softmax(logits[0].double(), dim=-1)
    n = 4000
    s = Sampler(CPU)
    counts = torch.zeros(6, dtype=torch.float64)
    batch = 500
    for start in range(0, n, batch):
        params = [SamplingParams(temperature=1.0, seed=seed) for seed in range(start, start + batch)]
        toks = s(logits.expand(batch, -1), params, [0] * batch).token_ids
        counts += torch.bincount(torch.tensor(toks), minlength=6).double()
    expected = probs * n
    try:
        from scipy.stats import chisquare
    except ImportError:  # pragma: no cover - loose check without scipy
        assert torch.allclose(counts / n, probs, atol=0.02)
    else:
        p_value = chisquare(counts.numpy(), expected.numpy()).pvalue
        assert p_value > 1e-3, (counts.tolist(), expected.tolist(), p_value)
    assert torch.allclose(counts / n, probs, atol=0.03)


def test_seeded_output_indices_sweep_matches_softmax():
    """Same check over output indices of one seed (one request's token stream)."""
    logits = torch.tensor([[0.5, 1.5, -1.0, 0.0]])
    probs = torch.softmax(logits[0].double(), dim=-1)
    n = 4000
    s = Sampler(CPU)
    sp = [SamplingParams(seed=9)] * n
    toks = s(logits.expand(n, -1), sp, list(range(n))).token_ids
    counts = torch.bincount(torch.tensor(toks), minlength=4).double()
    try:
        from scipy.stats import chisquare
    except ImportError:  # pragma: no cover
        assert torch.allclose(counts / n, probs, atol=0.03)
    else:
        assert chisquare(counts.numpy(), (probs * n).numpy()).pvalue > 1e-3


def test_temperature_flattens_and_sharpens():
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    n = 3000
    s = Sampler(CPU)
    for t in (0.5, 2.0):
        params = [SamplingParams(temperature=t, seed=k) for k in range(n)]
        toks = s(logits.expand(n, -1), params, [0] * n).token_ids
        freq = torch.bincount(torch.tensor(toks), minlength=3).double() / n
        assert torch.allclose(freq, torch.softmax(logits[0].double() / t, -1), atol=0.035), t


# ---- logprobs ----------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0, 1.7])
def test_logprobs_are_raw_log_softmax(sampler, temperature):
    logits = _logits(6, 40, seed=5)
    n = 5
    params = [SamplingParams(temperature=temperature, seed=i, logprobs=n, top_k=10)
              for i in range(6)]
    res = sampler(logits, params, [0] * 6)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert res.any_logprobs
    for i in range(6):
        tok = res.token_ids[i]
        ids, lps = res.logprob_token_ids[i], res.logprobs[i]
        assert len(ids) == len(lps) == n + 1
        assert ids[0] == tok
        assert lps[0] == pytest.approx(float(ref[i, tok]), abs=1e-5)
        best = torch.argsort(ref[i], descending=True)[:n].tolist()
        assert ids[1:] == best
        for j, t in zip(ids[1:], lps[1:]):
            assert t == pytest.approx(float(ref[i, j]), abs=1e-5)
        assert lps[1:] == sorted(lps[1:], reverse=True)
        full_order = torch.argsort(ref[i], descending=True).tolist()
        assert res.ranks[i] == full_order.index(tok) + 1
        if temperature == 0.0:
            assert res.ranks[i] == 1 and tok == best[0]


def test_rank_of_a_sampled_non_top_token(sampler):
    """Over many seeded draws, every chosen token's rank is its place in the raw order."""
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.5, 1.0]])
    order = torch.argsort(logits[0], descending=True).tolist()
    params = [SamplingParams(seed=k, logprobs=2) for k in range(300)]
    res = sampler(logits.expand(300, -1), params, [0] * 300)
    seen = set()
    for tok, rank, ids in zip(res.token_ids, res.ranks, res.logprob_token_ids):
        assert rank == order.index(tok) + 1
        assert ids == [tok] + order[:2]
        seen.add(rank)
    assert {1, 2, 3} <= seen


def test_logprobs_zero_and_mixed_batch(sampler):
    logits = _logits(3, 20, seed=6)
    params = [SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=20)]
    res = sampler(logits, params, [0, 0, 0])
    ref = torch.log_softmax(logits, dim=-1)
    assert res.logprob_token_ids[0] == [res.token_ids[0]]
    assert res.logprobs[0] == [pytest.approx(float(ref[0, res.token_ids[0]]), abs=1e-5)]
    assert res.ranks[0] == 1
    assert res.logprob_token_ids[1] == [] and res.logprobs[1] == [] and res.ranks[1] == 0
    assert len(res.logprob_token_ids[2]) == 21
    assert sorted(res.logprob_token_ids[2][1:]) == list(range(20))


# ---- SamplingParams validation -----------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("temperature", -1.0),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", float("nan")),
    ("top_k", -2),
    ("min_p", 2.0),
    ("min_p", -0.1),
    ("logprobs", 21),
    ("logprobs", -1),
    ("stop_token_ids", [-1]),
])
def test_sampling_params_validation_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_validate_after_mutation():
    sp = SamplingParams()
    sp.top_p = 0.0
    with pytest.raises(ValueError, match="top_p"):
        sp.validate()


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=1), dict(temperature=0.0), dict(temperature=0), dict(top_p=1.0),
    dict(top_p=1e-6), dict(top_k=-1), dict(top_k=0), dict(top_k=1), dict(min_p=0.0),
    dict(min_p=1.0), dict(logprobs=0), dict(logprobs=20), dict(seed=0), dict(seed=-5),
    dict(stop_token_ids=[0, 7]),
])
def test_sampling_params_accepts_edges(kwargs):
    SamplingParams(**kwargs)


def test_sampling_params_properties():
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy
    assert SamplingParams(top_k=-1).effective_top_k == 0
    assert SamplingParams(top_k=0).effective_top_k == 0
    assert SamplingParams(top_k=7).effective_top_k == 7
    assert math.isclose(SamplingParams().temperature, 1.0)


# ---- the batched draw of unseeded rows ---------------------------------------------------

def _knobs(params):
    from stages.sampler import apply_filters_batch

    def col(f, dtype):
        return torch.tensor([f(sp) for sp in params], dtype=dtype)

    return apply_filters_batch, (col(lambda sp: sp.temperature, torch.float32),
                                 col(lambda sp: sp.effective_top_k, torch.long),
                                 col(lambda sp: sp.top_p, torch.float32),
                                 col(lambda sp: sp.min_p, torch.float32))


def test_batched_filters_equal_the_per_row_filters():
    """Every row of a mixed batch is filtered exactly as apply_filters filters it alone."""
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
              for t in (0.3, 1.0, 1.7) for k in (-1, 1, 7) for p in (1.0, 0.9, 0.2)
              for m in (0.0, 0.05)]
    logits = _logits(len(params), 300, seed=11)
    batch_filters, knobs = _knobs(params)
    out = batch_filters(logits, *knobs, max_top_k=max(sp.effective_top_k for sp in params))
    for i, sp in enumerate(params):
        alone = apply_filters(logits[i], sp)
        assert torch.equal(torch.isfinite(out[i]), torch.isfinite(alone)), (i, sp)
        kept = torch.isfinite(alone)
        torch.testing.assert_close(out[i][kept], alone[kept], rtol=0, atol=0)


def test_unseeded_batch_draws_follow_each_rows_filtered_softmax(sampler):
    """One call draws 3000 rows of each of four settings: each group's frequencies match its
    own filtered softmax, and no filtered token is ever drawn."""
    sampler.unseeded.manual_seed(5)
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -2.0, 0.7, 1.4])
    settings = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_k=3),
                SamplingParams(temperature=1.4, top_p=0.7, min_p=0.05),
                SamplingParams(temperature=1.0, min_p=0.2, top_k=8)]  # min_p drops 3 tokens
    n = 3000
    params = [sp for sp in settings for _ in range(n)]
    toks = torch.tensor(sampler(logits.expand(len(params), -1), params, [0] * len(params)).token_ids)
    for g, sp in enumerate(settings):
        probs = torch.softmax(apply_filters(logits.clone(), sp).double(), dim=-1)
        counts = torch.bincount(toks[g * n:(g + 1) * n], minlength=8).double()
        assert (counts[probs == 0] == 0).all(), (sp, counts)
        assert torch.allclose(counts / n, probs, atol=0.03), (sp, counts / n, probs)


def test_race_never_draws_a_zero_probability_token():
    from stages.sampler import race

    probs = torch.zeros(4000, 50)
    probs[:, 7] = 0.25
    probs[:, 31] = 0.75
    drawn = race(probs, torch.empty_like(probs).exponential_(generator=torch.Generator().manual_seed(0)))
    assert set(drawn.tolist()) == {7, 31}
    assert abs((drawn == 31).double().mean().item() - 0.75) < 0.03


def test_mixed_batch_lands_each_draw_on_its_own_row(sampler):
    """Greedy, seeded and unseeded rows interleaved, each with its own argmax (the rows top-2
    gap is at least 0.0137, so at T=1e-4 a draw is its argmax but for e^-137): the unseeded
    rows run at top_k=1 (so their draw is their argmax) among rows whose top_k is off (0,
    -1, vocab, more), and every row's token is its own row's."""
    vocab = 64
    logits = _logits(12, vocab, seed=21)
    want = torch.argmax(logits, dim=-1).tolist()
    params = []
    for i in range(12):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0.0))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=50.0, top_k=1))
        else:
            params.append(SamplingParams(temperature=1e-4, top_k=(0, -1, vocab, 10 * vocab)[i % 4],
                                         seed=(i if i % 2 else None)))
    got = sampler(logits, params, list(range(12))).token_ids
    assert got == want, (got, want)


def test_top_k_off_rows_beside_top_k_rows_keep_every_token():
    """Through the sampler's own host path (_draw): a row whose top_k is off (0, -1,
    >= vocab) keeps every token while another row of the batch uses top_k=2."""
    from stages.sampler import race as real_race
    import stages.sampler as sampler_mod

    seen = {}

    def spy(probs, noise):
        seen["probs"] = probs.clone()
        return real_race(probs, noise)

    vocab = 16
    logits = _logits(5, vocab, seed=8, scale=0.5)
    params = [SamplingParams(temperature=1.0, top_k=k) for k in (2, 0, -1, vocab, vocab + 5)]
    orig = sampler_mod.race
    sampler_mod.race = spy
    try:
        Sampler(CPU)(logits, params, [0] * 5)
    finally:
        sampler_mod.race = orig
    kept = (seen["probs"] > 0).sum(dim=-1).tolist()
    assert kept == [2, vocab, vocab, vocab, vocab], kept


# ---- greedy in the model's dtype -----------------------------------------------------------

def test_greedy_batch_in_bf16_equals_float32_argmax_ties_included(sampler):
    logits = _logits(64, 300, seed=11).to(torch.bfloat16)
    logits[::3, 7] = logits[::3].max(dim=-1).values  # exact ties with an earlier or later max
    logits[1::3, 250] = logits[1::3].max(dim=-1).values
    params = [SamplingParams(temperature=0.0)] * 64
    ours = sampler.greedy(logits)
    assert ours.tolist() == torch.argmax(logits.float(), dim=-1).tolist()
    assert sampler.sample(logits.float(), params, [0] * 64).tolist() == ours.tolist()


def test_which_rows_are_greedy():
    """A row takes the bf16 argmax path only if its params are greedy (the last rank reads
    InputBatch.greedy, set from SamplingParams.is_greedy)."""
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.0, top_k=5).is_greedy
    assert not SamplingParams().is_greedy  # the default temperature is 1.0
    assert not SamplingParams(temperature=0.7).is_greedy
    assert not SamplingParams(temperature=0.5, seed=3).is_greedy


def test_token_logprobs_for_many_rows_at_once_equal_row_by_row():
    from stages.sampler import token_logprobs

    logits = _logits(40, 120, seed=12)
    logits[5, 17] = logits[5, 3] = logits[5].max() + 1.0  # a tie at the top
    lp = torch.log_softmax(logits, dim=-1)
    tokens = [int(t) for t in torch.randint(0, 120, (40,), generator=torch.Generator().manual_seed(1))]
    tokens[5] = 17
    nums = [i % 6 for i in range(40)]  # 0 (the chosen token only) to 5, mixed in one call
    got = token_logprobs(lp, tokens, nums)
    assert len(got) == 40
    for row, t, n, (ids, vals, rank) in zip(lp, tokens, nums, got):
        top = torch.topk(row, n) if n else None
        assert ids == [t] + (top.indices.tolist() if n else [])
        assert vals == [float(row[t])] + (top.values.tolist() if n else [])
        assert rank == int((row > row[t]).sum()) + 1
    assert got[5][2] == 1  # tied with the other top token: both rank 1
    assert token_logprobs(lp[:0], [], []) == []


# ---- seeded draws and the race --------------------------------------------------------------

def test_seeded_draws_never_pick_a_near_impossible_token():
    """A peaked row over a large vocabulary: the other tokens (p ~ 1e-13 each) never win,
    over many output indices (the 24-bit noise gave one of them u = 1 about once in 110)."""
    logits = torch.full((1, 151936), -20.0)
    logits[0, 42] = 10.0
    s = Sampler(CPU)
    params = [SamplingParams(temperature=1.0, seed=9)] * 64
    for start in range(0, 512, 64):
        toks = s.sample(logits.expand(64, -1), params, list(range(start, start + 64)))
        assert set(toks.tolist()) == {42}


def test_race_floors_zero_noise_at_float32_resolution():
    from stages.sampler import MIN_NOISE, race

    probs = torch.full((3, 1000), 1e-13)
    probs[:, 5] = 1.0 - 999e-13
    noise = torch.ones(3, 1000)
    noise[:, 700] = 0.0  # a u rounded to 1
    assert race(probs, noise).tolist() == [5, 5, 5]
    assert noise.min() == MIN_NOISE


def test_attach_logprobs_regroups_entries_per_request():
    """LastRank._attach_logprobs: requests without logprobs, with 0, with n, and a request
    that emits fewer tokens than it has rows (rejected drafts), against row-by-row values."""
    from ray_runtime.messages import SamplerOutput
    from stages.last_rank import LastRank

    vocab = 40
    rows = [_logits(3, vocab, seed=20), _logits(1, vocab, seed=21), _logits(3, vocab, seed=22),
            _logits(2, vocab, seed=23)]
    params = [SamplingParams(logprobs=2), SamplingParams(), SamplingParams(logprobs=0),
              SamplingParams(logprobs=4)]
    emitted = [[3, 7, 1], [9], [4, 4], [11]]  # request 2: 2 of 3 rows, request 3: 1 of 2
    out = SamplerOutput(step_id=1, req_ids=["a", "b", "c", "d"], incarnations=[0] * 4,
                        sampled_token_ids=emitted)
    LastRank._attach_logprobs(out, rows, params)
    for lg, toks, sp, ids, vals, ranks in zip(rows, emitted, params, out.logprob_token_ids,
                                              out.logprobs, out.num_logprob_ranks):
        if sp.logprobs is None:
            assert ids == vals == ranks == []
            continue
        assert len(ids) == len(vals) == len(ranks) == len(toks)
        lp = torch.log_softmax(lg, dim=-1)
        for j, t in enumerate(toks):
            top = torch.topk(lp[j], sp.logprobs) if sp.logprobs else None
            assert ids[j] == [t] + (top.indices.tolist() if top is not None else [])
            assert vals[j] == pytest.approx([float(lp[j, t])] + (top.values.tolist() if top is not None else []))
            assert ranks[j] == int((lp[j] > lp[j, t]).sum()) + 1
