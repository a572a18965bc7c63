"""Rejection sampling: the Triton kernel against the torch reference, bit for bit, on CPU
through Triton's interpreter (TRITON_INTERPRET=1); and the reference's statistics (every
emitted token distributed as the target's p) by chi-square over many seeded trials."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402
from scipy.stats import chisquare  # noqa: E402

from kernels.rejection_sampler import rejection_sample_ref  # noqa: E402
from kernels.rejection_sampler_triton import rejection_sample_triton  # noqa: E402


def _inputs(B, K, V, *, greedy, probs=True, draft_probs=True, num_drafts=None, seed=0):
    """greedy: a bool for all rows or a list of per-row bools. Drafts are drawn from q (or
    copy the target's argmax for greedy rows) often enough that long accepted runs happen."""
    g = torch.Generator().manual_seed(seed)
    is_greedy = torch.tensor([greedy] * B if isinstance(greedy, bool) else greedy)
    if num_drafts is None:
        num_drafts = torch.randint(0, K + 1, (B,), generator=g)
    num_drafts = torch.as_tensor(num_drafts, dtype=torch.int64)
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    logits[torch.rand(B, K + 1, V, generator=g) < 0.3] = float("-inf")  # top-k style zeros
    logits[..., 0] = logits[..., 0].clamp(min=0)  # no row is all -inf
    target = torch.softmax(logits, -1)
    argmax = target.argmax(-1)
    q = torch.softmax(logits[:, :K] + 0.5 * torch.randn(B, K, V, generator=g), -1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K) if K else \
        torch.zeros(B, 0, dtype=torch.int64)
    copy = torch.rand(B, K, generator=g) < 0.7
    drafts = torch.where(copy & is_greedy[:, None], argmax[:, :K], drafts)
    return dict(draft_token_ids=drafts, num_drafts=num_drafts, target_argmax=argmax,
                target_probs=target if probs else None,
                draft_probs=q if probs and draft_probs else None,
                uniforms=torch.rand(B, K, generator=g),
                exp_noise=torch.empty(B, V).exponential_(generator=g) if probs else None,
                is_greedy=is_greedy)


def _check(block_v=1024, **kw):
    args = _inputs(**kw)
    ref = rejection_sample_ref(**args)
    ours = rejection_sample_triton(**args, block_v=block_v)
    assert ours.dtype == torch.int64 and ours.shape == ref.shape
    assert torch.equal(ours, ref), f"\nours {ours}\nref  {ref}"
    return ref


@pytest.mark.parametrize("V", [37, 100])
@pytest.mark.parametrize("block_v", [16, 1024])
def test_all_greedy_without_probs(V, block_v):
    ref = _check(B=6, K=4, V=V, greedy=True, probs=False, seed=V, block_v=block_v)
    assert (ref[:, 1:] != -1).any()  # some drafts were accepted


@pytest.mark.parametrize("V", [37, 100])
@pytest.mark.parametrize("block_v", [16, 1024])
@pytest.mark.parametrize("draft_probs", [False, True])
def test_all_random(V, block_v, draft_probs):
    _check(B=8, K=3, V=V, greedy=False, draft_probs=draft_probs, seed=V + block_v, block_v=block_v)


@pytest.mark.parametrize("draft_probs", [False, True])
def test_mixed_rows_and_num_drafts(draft_probs):
    greedy = [True, False, False, True, False, True, False, False]
    ref = _check(B=8, K=4, V=100, greedy=greedy, draft_probs=draft_probs, block_v=32,
                 num_drafts=[0, 4, 0, 4, 2, 1, 3, 4], seed=7)
    assert (ref[[0, 2], 1:] == -1).all() and (ref[[0, 2], 0] >= 0).all()


@pytest.mark.parametrize("seed", range(4))
def test_many_seeds(seed):
    greedy = (torch.arange(12) % 3 == 0).tolist()
    _check(B=12, K=5, V=37, greedy=greedy, draft_probs=seed % 2 == 0, block_v=16, seed=seed)


@pytest.mark.parametrize("probs,draft_probs", [(False, False), (True, False), (True, True)])
def test_k_zero_bonus_only(probs, draft_probs):
    ref = _check(B=5, K=0, V=37, greedy=[True, False, True, False, False] if probs else True,
                 probs=probs, draft_probs=draft_probs, block_v=16)
    assert ref.shape == (5, 1) and (ref >= 0).all()


@pytest.mark.parametrize("greedy", [True, False])
def test_single_request(greedy):
    _check(B=1, K=3, V=100, greedy=greedy, num_drafts=[3], block_v=16, seed=3)


def test_greedy_planted_prefix():
    V, K = 50, 5
    args = _inputs(2, K, V, greedy=True, num_drafts=[5, 5])
    argmax = torch.tensor([[3, 9, 4, 7, 1, 2], [5, 5, 5, 5, 5, 5]])
    drafts = torch.tensor([[3, 9, 4, 8, 1], [5, 5, 5, 5, 5]])  # row 0 mismatches at 3
    args.update(draft_token_ids=drafts, target_argmax=argmax)
    want = torch.tensor([[3, 9, 4, 7, -1, -1], [5, 5, 5, 5, 5, 5]])
    assert torch.equal(rejection_sample_ref(**args), want)
    assert torch.equal(rejection_sample_triton(**args, block_v=16), want)
    args.update(target_probs=None, draft_probs=None, exp_noise=None)
    assert torch.equal(rejection_sample_triton(**args), want)


def test_random_planted_prefix_and_ties():
    """p(d) = 1 accepts any draft; at 3, p(d) = 0 rejects; with flat noise the correction is
    the lowest index of the (tied) maximum residual, across BLOCK_V chunks."""
    V, K = 40, 5
    p = torch.zeros(1, K + 1, V)
    drafts = torch.tensor([[2, 30, 17, 5, 6]])
    for j in range(3):
        p[0, j, drafts[0, j]] = 1.0
    p[0, 3, [20, 33, 38]] = torch.tensor([0.25, 0.5, 0.25])  # draft 5 has p = 0: rejected
    p[0, 3, 5] = 0.0
    q = torch.full((1, K, V), 1.0 / V)
    q[0, 3] = 0.0
    q[0, 3, [5, 20, 33]] = torch.tensor([0.5, 0.0, 0.25])  # residual: 0.25 at 20, 33 and 38
    args = dict(draft_token_ids=drafts, num_drafts=torch.tensor([5]),
                target_argmax=p.argmax(-1), target_probs=p, draft_probs=q,
                uniforms=torch.full((1, K), 0.999), exp_noise=torch.ones(1, V),
                is_greedy=torch.tensor([False]))
    want = torch.tensor([[2, 30, 17, 20, -1, -1]])
    assert torch.equal(rejection_sample_ref(**args), want)
    for block_v in (16, 32, 1024):
        assert torch.equal(rejection_sample_triton(**args, block_v=block_v), want)


def test_launcher_validation():
    args = _inputs(3, 2, 37, greedy=False)
    bad = dict(args, uniforms=torch.rand(3, 3))
    with pytest.raises(ValueError, match="uniforms"):
        rejection_sample_triton(**bad)
    with pytest.raises(ValueError, match="exp_noise"):
        rejection_sample_triton(**dict(args, exp_noise=torch.ones(3, 36)))
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample_triton(**dict(args, target_probs=None))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample_triton(**dict(args, draft_probs=args["draft_probs"].double()))
    # non-contiguous inputs are accepted and give the same answer
    tp = args["target_probs"].transpose(0, 1).contiguous().transpose(0, 1)
    assert not tp.is_contiguous()
    assert torch.equal(rejection_sample_triton(**dict(args, target_probs=tp)),
                       rejection_sample_ref(**args))


# ---- statistics of the reference: every emitted token is distributed as p ----------------

N, V_S = 20000, 6
P = torch.tensor([[0.30, 0.05, 0.25, 0.10, 0.20, 0.10],
                  [0.10, 0.15, 0.05, 0.40, 0.10, 0.20],
                  [0.20, 0.20, 0.20, 0.10, 0.10, 0.20]])
Q = torch.tensor([[0.05, 0.40, 0.10, 0.25, 0.05, 0.15],
                  [0.30, 0.10, 0.20, 0.10, 0.20, 0.10]])


def _trials(one_hot, seed):
    g = torch.Generator().manual_seed(seed)
    if one_hot:  # an n-gram draft: deterministic tokens, q = one-hot
        drafts, q = torch.tensor([[2, 3]]).expand(N, 2), None
    else:
        drafts = torch.multinomial(Q, N, replacement=True, generator=g).T
        q = Q.expand(N, 2, V_S)
    return dict(draft_token_ids=drafts.contiguous(), num_drafts=torch.full((N,), 2),
                target_argmax=P.argmax(-1).expand(N, 3), target_probs=P.expand(N, 3, V_S),
                draft_probs=q, uniforms=torch.rand(N, 2, generator=g),
                exp_noise=torch.empty(N, V_S).exponential_(generator=g),
                is_greedy=torch.zeros(N, dtype=torch.bool))


def _pvalue(tokens, p):
    counts = torch.bincount(tokens, minlength=V_S).double()
    expected = p.double() / p.double().sum() * counts.sum()
    return chisquare(counts.numpy(), expected.numpy()).pvalue


@pytest.mark.parametrize("one_hot", [False, True])
def test_reference_emits_target_distribution(one_hot):
    args = _trials(one_hot, seed=11 + one_hot)
    out = rejection_sample_ref(**args)
    assert _pvalue(out[:, 0], P[0]) > 1e-3
    accepted = out[:, 1] != -1  # position 1 is filled only when draft 0 passed
    assert accepted.sum() > N // 5
    assert _pvalue(out[accepted, 1], P[1]) > 1e-3


def test_planted_bug_fails_chisquare():
    """Drawing the correction from p instead of norm(max(p - q, 0)) skews the first token."""
    args = _trials(one_hot=False, seed=5)
    d, u, e = args["draft_token_ids"][:, 0], args["uniforms"][:, 0], args["exp_noise"]
    p, q = P[0], Q[0]
    accept = u * q[d] < p[d]
    for w, good in ((torch.clamp(p - q, min=0.0), True), (p, False)):
        tok = torch.where(accept, d, torch.argmax(w / e, dim=-1))
        assert (_pvalue(tok, p) > 1e-3) == good
