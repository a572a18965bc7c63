"""The driver's canonical view of one request: the single source of truth for its tokens.

Ranks hold copies of `token_ids[:num_tokens_sent]`; a lost or confused rank can always be
rebuilt from this object alone.
"""
from __future__ import annotations

import enum
from typing import Optional

import numpy as np

from ray_runtime.digest import MASK64, extend_hash, hash_weights
from ray_runtime.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_FINISHED = RequestStatus.FINISHED

# digest.py's weights as Python ints, for the O(1) hash update of a committed token (a numpy
# scalar per token costs more than the rest of the commit). Every table of hash_weights is a
# prefix of the next larger one, so this list is too: extend_hash gives the same values.
_weights: list[int] = hash_weights(1).tolist()


def _weights_for(length: int) -> list[int]:
    """At least `length` weights (the module list, replaced by the next table size)."""
    global _weights
    if length > len(_weights):
        _weights = hash_weights(length).tolist()
    return _weights


def hash_extend(h: int, start: int, tokens: list[int]) -> int:
    """extend_hash(h, start, tokens) with the weights as Python ints (drafts: a few tokens)."""
    end = start + len(tokens)
    w = _weights if end <= len(_weights) else _weights_for(end)
    for i, t in enumerate(tokens, start):
        h += t * w[i]
    return h & MASK64


def prefix_hash(tokens: list[int]) -> int:
    """extend_hash(0, 0, tokens), vectorized for long prefixes (a prompt)."""
    n = len(tokens)
    if n < 64:
        return extend_hash(0, 0, tokens)
    try:
        arr = np.asarray(tokens, dtype=np.int64).view(np.uint64)  # two's complement: t mod 2**64
    except (OverflowError, TypeError, ValueError):
        return extend_hash(0, 0, tokens)
    with np.errstate(over="ignore"):
        return int((arr * hash_weights(n)[:n]).sum(dtype=np.uint64)) & MASK64


class Request:
    def __init__(self, req_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 eos_token_ids: frozenset[int], arrival_index: int) -> None:
        self.req_id = req_id
        self.sampling = sampling
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + committed outputs
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_hash = prefix_hash(self.token_ids)  # digest.py, over token_ids
        # Scheduled so far (optimistic: counted when planned). With async placeholders it
        # may run one ahead of num_tokens: the token being computed is still in flight.
        self.num_computed_tokens = 0
        self.num_tokens_sent = 0  # prefix of token_ids that the ranks' rows hold
        self.num_inflight_steps = 0  # planned steps of this incarnation not yet returned
        self.num_pending_samples = 0  # of those, the ones that will sample a token
        self.incarnation = 0  # bumped on every admission into the ranks' batches
        self.lane = 0  # the micro-batch it runs in (Scheduler.num_lanes), set at admission
        # The last rank's latest proposal of drafts (speculative decoding), for the next
        # step of this incarnation only: cleared when planned, preempted or re-admitted.
        self.draft_token_ids: list[int] = []
        # The in-flight plan (PlanRecord) in which the rank runs this request's own drafts
        # (PP=1 async), corrected when the step before it returns; None if there is none.
        self.self_drafted_record = None
        self.status = RequestStatus.WAITING
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[int] = None
        self.eos_token_ids = eos_token_ids
        self.arrival_index = arrival_index
        self.num_preemptions = 0
        # Per output token: ({token_id: logprob}, rank of the chosen token), when asked.
        self.logprobs: list[tuple[dict[int, float], int]] = []
        # Set by Scheduler.add_request: pop_finished returns requests in this order.
        self.add_seq = 0
        # The stop checks of append_output_token, precomputed (sampling is fixed per request).
        self._eos_ids = None if sampling.ignore_eos else eos_token_ids
        self._stop_ids = frozenset(sampling.stop_token_ids) if sampling.stop_token_ids else None
        # len(token_ids) at which max_tokens finishes the request
        self.length_limit = self.num_prompt_tokens + sampling.max_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is _FINISHED

    def append_output_token(self, token_id: int, max_model_len: int) -> None:
        """Commit one sampled token and decide whether the request is done. O(1): the hash
        is extended by one weighted term (extend_hash's formula)."""
        token_ids = self.token_ids
        n = len(token_ids)
        w = _weights if n < len(_weights) else _weights_for(n + 1)
        self.token_hash = (self.token_hash + token_id * w[n]) & MASK64
        token_ids.append(token_id)
        n += 1
        if self._eos_ids is not None and token_id in self._eos_ids:
            self._finish("stop")
        elif self._stop_ids is not None and token_id in self._stop_ids:
            self._finish("stop", stop_reason=token_id)
        elif n >= self.length_limit or n >= max_model_len:
            self._finish("length")

    def _finish(self, reason: str, stop_reason: Optional[int] = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def abort(self) -> None:
        self._finish("abort")
