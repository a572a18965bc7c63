"""stages/ngram_proposer.py: prompt-lookup drafts, on hand-made sequences (numpy only)."""
from __future__ import annotations

import numpy as np
import pytest

from stages.ngram_proposer import ngram_propose


def propose(tokens, k=3, lo=1, hi=4):
    return ngram_propose(np.array(tokens, np.int64), k, lo, hi)


def test_longest_suffix_wins_over_a_more_recent_shorter_one():
    # suffix [1, 2]: the 2-gram occurs at 0 (continuation 3, 9, 2); the 1-gram [2] occurs
    # more recently at 4 (continuation 5, 1, 2). The longer match wins.
    tokens = [1, 2, 3, 9, 2, 5, 1, 2]
    assert propose(tokens, k=3, hi=2) == [3, 9, 2]
    assert propose(tokens, k=3, hi=4) == [3, 9, 2]
    # Limited to 1-grams, the most recent occurrence of [2] wins.
    assert propose(tokens, k=3, hi=1) == [5, 1, 2]


def test_three_gram_beats_two_gram():
    # suffix [7, 8, 9]: as a 3-gram only at 0 (-> 40); as a 2-gram [8, 9] also at 5 (-> 50)
    tokens = [7, 8, 9, 40, 0, 8, 9, 50, 7, 8, 9]
    assert propose(tokens, k=1, hi=3) == [40]
    assert propose(tokens, k=1, hi=2) == [50]
    assert propose(tokens, k=1, lo=3, hi=3) == [40]


def test_most_recent_occurrence_wins():
    tokens = [4, 7, 1, 4, 7, 2, 4, 7]
    assert propose(tokens, k=3, lo=2, hi=2) == [2, 4, 7]
    assert propose(tokens, k=2, lo=1, hi=4) == [2, 4]


def test_returns_at_most_k():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    for k in range(1, 7):
        assert propose(tokens, k=k, hi=2) == [3, 4, 5, 6, 7, 8][:k]


def test_fewer_than_k_near_the_end():
    # [5] recurs at 0: what followed it runs to the end of the sequence (2 tokens)
    assert propose([5, 6, 5], k=3) == [6, 5]
    # a run of one token: the 3-gram at 0 is followed by a single token
    assert propose([7, 7, 7, 7], k=4, hi=3) == [7]
    # the occurrence right before the suffix: the continuation is the suffix itself
    assert propose([1, 2, 3, 3], k=5) == [3]


def test_nothing_recurs():
    assert propose([1, 2, 3, 4, 5], k=3) == []
    assert propose([9], k=3) == []
    assert propose([], k=3) == []


def test_the_suffix_never_matches_itself():
    # the last n tokens occur only as the suffix: no proposal
    assert propose([1, 2, 3], k=2, lo=1, hi=3) == []


@pytest.mark.parametrize("k", [0, -1])
def test_k_not_positive(k):
    assert propose([1, 2, 1, 2, 1], k=k) == []


def test_lookup_min_respected():
    tokens = [6, 1, 9, 2, 1]  # only the 1-gram [1] recurs
    assert propose(tokens, k=2, lo=1, hi=3) == [9, 2]
    assert propose(tokens, k=2, lo=2, hi=3) == []


def test_lookup_max_larger_than_the_sequence():
    assert propose([3, 4, 3], k=2, lo=1, hi=10) == [4, 3]


def test_returns_plain_python_ints():
    got = propose([1, 2, 1], k=2)
    assert got == [2, 1] and all(type(t) is int for t in got)


def test_brute_force_agreement():
    """Against a direct reading of the rule on random low-entropy sequences."""
    rng = np.random.default_rng(0)

    def brute(tokens, k, lo, hi):
        n_tok = len(tokens)
        if k <= 0:
            return []
        for n in range(min(hi, n_tok - 1), lo - 1, -1):
            suffix = tokens[n_tok - n:]
            for i in range(n_tok - n - 1, -1, -1):  # most recent first, continuation exists
                if tokens[i:i + n] == suffix:
                    return tokens[i + n:i + n + k]
        return []

    for _ in range(300):
        tokens = rng.integers(0, 4, rng.integers(1, 20)).tolist()
        k, lo = int(rng.integers(0, 5)), int(rng.integers(1, 3))
        hi = lo + int(rng.integers(0, 4))
        assert propose(tokens, k=k, lo=lo, hi=hi) == brute(tokens, k, lo, hi), (tokens, k, lo, hi)
