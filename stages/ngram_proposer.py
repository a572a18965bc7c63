"""Prompt-lookup (n-gram) drafts: find the request's last n tokens earlier in its own
sequence and propose what followed them there.

The longest suffix wins (n from prompt_lookup_max down to prompt_lookup_min), and for that
n the most recent earlier occurrence. Plain numpy on the last rank's row; no model.
"""
from __future__ import annotations

import numpy as np


def ngram_propose(tokens: np.ndarray, k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """tokens: the known prefix (1-D). Returns up to k drafts (none when no n-gram recurs)."""
    n_tok = len(tokens)
    if k <= 0:
        return []
    for n in range(min(lookup_max, n_tok - 1), lookup_min - 1, -1):
        suffix = tokens[n_tok - n:]
        # windows[i] = tokens[i:i+n] for every start whose continuation exists (i + n < n_tok)
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:n_tok - 1], n)
        hits = np.nonzero((windows == suffix).all(axis=1))[0]
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []
