"""stages/spec_sampler.py: SpecVerifier end to end on CPU (the torch reference sampler) with
a tiny vocabulary: greedy rows, the emitted distribution (chi-square, many seeded requests
batched into one call), seeded determinism, and top-k filtering."""
from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare

from ray_runtime.sampling_params import SamplingParams
from stages.spec_sampler import SpecVerifier

V = 6
CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)


def verifier(seed: int = 0) -> SpecVerifier:
    return SpecVerifier(CPU, torch.Generator().manual_seed(seed))


def one_hot_logits(argmaxes: list[int]) -> torch.Tensor:
    """[len, V] logits whose row j peaks at argmaxes[j]."""
    lg = torch.randn(len(argmaxes), V, generator=torch.Generator().manual_seed(7))
    for j, a in enumerate(argmaxes):
        lg[j, a] = 10.0
    return lg


# ---- greedy ----------------------------------------------------------------------------------

def test_greedy_rows_emit_accepted_drafts_then_the_argmax():
    # target argmax per position: 1, 2, 3, 4 (4 is the bonus position)
    lg = one_hot_logits([1, 2, 3, 4])
    cases = [
        ([1, 2, 3], [1, 2, 3, 4]),  # all accepted: the bonus argmax follows
        ([1, 2, 5], [1, 2, 3]),     # third rejected: the argmax there
        ([1, 0, 3], [1, 2]),        # second rejected; the later match does not count
        ([5, 2, 3], [1]),           # first rejected
        ([1], [1, 2]),              # one draft
    ]
    drafts = [c[0] for c in cases]
    logits = [lg[:len(d) + 1] for d in drafts]
    got = verifier()(logits, drafts, [GREEDY] * len(cases), [0] * len(cases))
    assert got == [c[1] for c in cases]


def test_greedy_ignores_draft_probs():
    lg = one_hot_logits([1, 2, 3])
    q = torch.full((2, V), 1.0 / V)
    got = verifier()([lg], [[1, 0]], [GREEDY], [0], [q])
    assert got == [[1, 2]]


def test_greedy_and_random_rows_in_one_batch():
    lg = one_hot_logits([1, 2, 3, 4])
    hot = SamplingParams(temperature=1.0, seed=3)
    drafts = [[1, 2, 3], [1, 2, 3], [5]]
    logits = [lg, lg, lg[:2]]
    got = verifier()(logits, drafts, [GREEDY, hot, GREEDY], [0, 0, 0])
    assert got[0] == [1, 2, 3, 4] and got[2] == [1]
    assert 1 <= len(got[1]) <= 4 and all(0 <= t < V for t in got[1])


# ---- the emitted distribution ----------------------------------------------------------------

N = 2000
LOGITS = torch.tensor([[1.0, 0.2, -0.5, 0.7, 0.0, -1.2],
                       [0.3, 1.1, 0.0, -0.4, 0.9, 0.1],
                       [-0.2, 0.5, 0.8, 0.0, -1.0, 0.4]])
# A draft distribution unlike the target's (its mode is the target's second-least likely)
Q = torch.tensor([[0.05, 0.1, 0.45, 0.1, 0.2, 0.1],
                  [0.3, 0.05, 0.15, 0.2, 0.1, 0.2]])


def first_token_counts(drafts: list[list[int]], q: list | None, params: list[SamplingParams],
                       logits: torch.Tensor = LOGITS) -> tuple[np.ndarray, list[list[int]]]:
    out = verifier()([logits] * len(drafts), drafts, params, [0] * len(drafts), q)
    assert all(1 <= len(o) <= len(d) + 1 for o, d in zip(out, drafts))
    return np.bincount([o[0] for o in out], minlength=V), out


def expected_counts(logits_row: torch.Tensor, n: int) -> np.ndarray:
    return torch.softmax(logits_row.double(), -1).numpy() * n


def test_first_token_distribution_with_draft_probs():
    """Drafts drawn from q (a model drafter): the first emitted token is distributed as
    softmax(logits[0]) whatever q is."""
    rng = np.random.default_rng(0)
    drafts = [[int(rng.choice(V, p=Q[j].numpy() / Q[j].sum().item())) for j in range(2)]
              for _ in range(N)]
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(N)]
    counts, out = first_token_counts(drafts, [Q] * N, params)
    p = chisquare(counts, expected_counts(LOGITS[0], N)).pvalue
    assert p > 1e-3, (counts, expected_counts(LOGITS[0], N), p)
    # the second token too, where the first draft was accepted
    acc = [o for o, d in zip(out, drafts) if o[0] == d[0]]
    assert len(acc) > N // 10
    second = np.bincount([o[1] for o in acc], minlength=V)
    p2 = chisquare(second, expected_counts(LOGITS[1], len(acc))).pvalue
    assert p2 > 1e-3, (second, p2)


def test_first_token_distribution_with_deterministic_drafts():
    """n-gram drafts (q=None: a one-hot q): the same target distribution."""
    drafts = [[2, 4]] * N  # 2 is unlikely under the target at position 0, 4 likely at 1
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(N)]
    counts, _ = first_token_counts(drafts, None, params)
    p = chisquare(counts, expected_counts(LOGITS[0], N)).pvalue
    assert p > 1e-3, (counts, expected_counts(LOGITS[0], N), p)


def test_first_token_distribution_with_the_likeliest_draft():
    drafts = [[0]] * N
    params = [SamplingParams(temperature=1.0, seed=10_000 + s) for s in range(N)]
    counts, _ = first_token_counts(drafts, None, params, LOGITS[:2])
    assert chisquare(counts, expected_counts(LOGITS[0], N)).pvalue > 1e-3


def test_temperature_is_applied():
    drafts = [[2]] * N
    params = [SamplingParams(temperature=0.5, seed=s) for s in range(N)]
    counts, _ = first_token_counts(drafts, None, params, LOGITS[:2])
    assert chisquare(counts, expected_counts(LOGITS[0] / 0.5, N)).pvalue > 1e-3


# ---- seeds -----------------------------------------------------------------------------------

def _seeded_batch(n: int = 40):
    drafts = [[2, 4, 1]] * n
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(n)]
    logits = [torch.cat([LOGITS, LOGITS[:1]])] * n
    return logits, drafts, params


def test_same_seed_same_tokens():
    logits, drafts, params = _seeded_batch()
    a = verifier(1)(logits, drafts, params, [0] * len(drafts), [None] * len(drafts))
    b = verifier(2)(logits, drafts, params, [0] * len(drafts))
    assert a == b
    assert len({tuple(t) for t in a}) > 5, "different seeds gave the same tokens"


def test_seeded_tokens_do_not_depend_on_the_batch():
    logits, drafts, params = _seeded_batch()
    whole = verifier()(logits, drafts, params, [0] * len(drafts))
    # the same requests alone, reversed, and next to a greedy row with more drafts
    for i in (0, 7, 31):
        alone = verifier()([logits[i]], [drafts[i]], [params[i]], [0])
        assert alone == [whole[i]]
    rev = verifier()(logits[::-1], drafts[::-1], params[::-1], [0] * len(drafts))
    assert rev[::-1] == whole
    lg5 = torch.randn(6, V)
    mixed = verifier()([lg5, logits[3]], [[1, 1, 1, 1, 1], drafts[3]],
                       [GREEDY, params[3]], [0, 0])
    assert mixed[1] == whole[3]


def test_output_index_changes_the_draws():
    logits, drafts, params = _seeded_batch()
    a = verifier()(logits, drafts, params, [0] * len(drafts))
    b = verifier()(logits, drafts, params, [5] * len(drafts))
    assert a != b


# ---- filters ---------------------------------------------------------------------------------

TOP_K = 2


def test_top_k_filter_respected():
    """A draft outside the top-k is never accepted, and no correction or bonus token lies
    outside the top-k of its position."""
    n = 400
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0],    # top-2 {0, 1}
                           [-2.0, -1.0, 0.0, 1.0, 2.0, 3.0],    # top-2 {4, 5}
                           [0.0, 3.0, -1.0, 2.9, -2.0, 1.0]])   # top-2 {1, 3}
    top = [set(torch.topk(row, TOP_K).indices.tolist()) for row in logits]
    rng = np.random.default_rng(1)
    drafts = [rng.integers(0, V, 2).tolist() for _ in range(n)]
    q = [torch.softmax(torch.randn(2, V, generator=torch.Generator().manual_seed(s)), -1)
         for s in range(n)]
    params = [SamplingParams(temperature=1.0, top_k=TOP_K, seed=s) for s in range(n)]
    for draft_probs in (None, q):
        out = verifier()([logits] * n, drafts, params, [0] * n, draft_probs)
        seen_outside_draft = 0
        for o, d in zip(out, drafts):
            for j, t in enumerate(o):
                assert t in top[j], f"token {t} at position {j} is outside the top-{TOP_K}"
            seen_outside_draft += d[0] not in top[0]
        assert seen_outside_draft > 0  # the scenario does offer drafts outside the top-k
        assert any(len(o) == 3 for o in out), "no request accepted both drafts"
