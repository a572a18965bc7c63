"""The driver's canonical view of one request: the single source of truth for its tokens.

Ranks hold copies of `token_ids[:num_tokens_sent]`; a lost or confused rank can always be
rebuilt from this object alone.
"""
from __future__ import annotations

import enum
from typing import Optional

from ray_runtime.digest import extend_hash
from ray_runtime.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(self, req_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 eos_token_ids: frozenset[int], arrival_index: int) -> None:
        self.req_id = req_id
        self.sampling = sampling
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + committed outputs
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_hash = extend_hash(0, 0, self.token_ids)  # digest.py, over token_ids
        # Scheduled so far (optimistic: counted when planned). With async placeholders it
        # may run one ahead of num_tokens: the token being computed is still in flight.
        self.num_computed_tokens = 0
        self.num_tokens_sent = 0  # prefix of token_ids that the ranks' rows hold
        self.num_inflight_steps = 0  # planned steps of this incarnation not yet returned
        self.num_pending_samples = 0  # of those, the ones that will sample a token
        self.incarnation = 0  # bumped on every admission into the ranks' batches
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
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int, max_model_len: int) -> None:
        """Commit one sampled token and decide whether the request is done."""
        self.token_hash = extend_hash(self.token_hash, len(self.token_ids), [token_id])
        self.token_ids.append(token_id)
        sp = self.sampling
        if not sp.ignore_eos and token_id in self.eos_token_ids:
            self._finish("stop")
        elif token_id in sp.stop_token_ids:
            self._finish("stop", stop_reason=token_id)
        elif self.num_output_tokens >= sp.max_tokens or self.num_tokens >= max_model_len:
            self._finish("length")

    def _finish(self, reason: str, stop_reason: Optional[int] = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def abort(self) -> None:
        self._finish("abort")
