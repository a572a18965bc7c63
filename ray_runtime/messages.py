"""Everything that crosses an actor boundary, as msgspec Structs.

The driver encodes each StepPlan once (msgpack) and puts the bytes in the object store; every
stage decodes the same bytes: that is the broadcast of new_token_ids. Nothing here carries a
row index: rows are rank-local, so requests are named by id and incarnation only.
"""
from __future__ import annotations

from typing import Optional

import msgspec

from ray_runtime.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True):
    """A request entering the ranks' batches: first scheduling, or resumption after preemption."""

    req_id: str
    incarnation: int  # bumped by the driver on every (re)admission; late results of older ones are dropped
    token_ids: list[int]  # the whole known prefix: prompt + every committed output token
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose KV is already valid in block_ids (0 here: no prefix cache)
    block_ids: list[int]
    sampling: SamplingParams


class CachedRequestData(msgspec.Struct, array_like=True):
    """A request already in the ranks' batches: only what changed since the last plan naming it."""

    req_id: str
    token_start: int  # position of new_token_ids[0] in the request's token sequence
    new_token_ids: list[int]  # tokens [token_start, token_start + len) of the driver's view
    new_block_ids: list[int]
    num_computed_tokens: int  # the driver's count before this step, checked by every rank
    # Index of new_block_ids[0] in the row's block table (a rollback shrinks it); None: append.
    block_start: Optional[int] = None
    # Speculative decoding: the drafts this step verifies, placed right after the known
    # prefix. Every plan naming a request states its drafts (none: an empty list).
    draft_token_ids: list[int] = []
    # PP=1 async: the rank runs its own latest tokens and drafts (1 + its drafts, at most
    # num_scheduled_tokens) from its own computed count; the driver corrects its view later.
    self_drafted: bool = False


class StepPlan(msgspec.Struct, array_like=True):
    step_id: int
    removed_req_ids: list[str]  # finished, aborted or preempted since the previous plan
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    # The order in which this step's tokens are laid out, and how many each request runs.
    scheduled_req_ids: list[str]
    num_scheduled_tokens: list[int]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


class SamplerOutput(msgspec.Struct, array_like=True):
    """The last rank's result for one step: one entry per request that reached the end of its
    known prefix (a request in the middle of a chunked prefill samples nothing)."""

    step_id: int
    req_ids: list[str]
    incarnations: list[int]
    sampled_token_ids: list[list[int]]  # a list per request: one token now, k+1 with drafts later
    # When logprobs were asked, per request and per emitted token (empty for a request that
    # did not ask): [chosen, top-1, ..., top-n] ids, their logprobs, the chosen one's rank.
    logprob_token_ids: Optional[list[list[list[int]]]] = None
    logprobs: Optional[list[list[list[float]]]] = None
    num_logprob_ranks: Optional[list[list[int]]] = None  # 1 = most likely
    # Speculative decoding, per request: drafts verified this step (the accepted ones are
    # len(sampled_token_ids[i]) - 1 of them), and the proposal for its next step.
    num_draft_tokens: Optional[list[int]] = None
    draft_token_ids: Optional[list[list[int]]] = None


class RowDigest(msgspec.Struct, array_like=True):
    """One rank's bookkeeping for one request, right after it applied a plan, over the
    prefix the driver has told it about (see ray_runtime/digest.py)."""

    req_id: str
    incarnation: int
    num_tokens_known: int  # the row's own counter
    hash_length: int  # the driver's count of known tokens, as the plan stated it
    num_computed_tokens: int
    token_hash: int  # over token_ids[:hash_length + num_draft_tokens] as the row holds them
    num_conflicts: int  # driver tokens that disagreed with what the row already held
    num_draft_tokens: int = 0  # drafts the row holds after the known prefix


class StageTiming(msgspec.Struct, array_like=True):
    """Wall-clock marks (time.time(), seconds) of one step on one stage, for the trace."""

    start: float  # the stage picked the plan up
    recv_done: float  # activations from the previous stage arrived (== start on rank 0)
    compute_done: float  # layers (and sampler) done
    end: float  # activations handed to the transport / result encoded
    digest_s: float  # time spent fingerprinting rows for the audit
    # CUDA: the device's span for the step (event to event); 0 on CPU or if not yet complete
    gpu_busy_s: float = 0.0
    # rank 0 with token feedback: time the host waited for the last rank's sampled tokens
    # (on CPU; on CUDA the device waits, which gpu_busy_s leaves out)
    token_wait_s: float = 0.0


class StageStepResult(msgspec.Struct, array_like=True):
    """What every stage returns for a step: timings and digests on every rank, the sampler
    output on the last rank."""

    step_id: int
    rank: int
    timing: StageTiming
    digests: list[RowDigest]
    sampler_output: Optional[SamplerOutput] = None


_plan_encoder = msgspec.msgpack.Encoder()
_plan_decoder = msgspec.msgpack.Decoder(StepPlan)
_result_decoder = msgspec.msgpack.Decoder(StageStepResult)


def encode(msg: msgspec.Struct) -> bytes:
    return _plan_encoder.encode(msg)


def decode_plan(data: bytes) -> StepPlan:
    return _plan_decoder.decode(data)


def decode_result(data: bytes) -> StageStepResult:
    return _result_decoder.decode(data)


class RequestSpec(msgspec.Struct, array_like=True):
    """A validated request, from the API to the driver."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams


class RequestDelta(msgspec.Struct, array_like=True, gc=False):
    """What the engine reports of one request since its previous delta: the output tokens
    committed since then (all of them, for a request that asked only for its final output),
    and on finishing, why. `error` is set when the request failed with the engine (a stage
    error, a bookkeeping mismatch under on_mismatch="raise"): its consumer raises it."""

    req_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: Optional[str] = None
    stop_reason: Optional[int] = None
    num_preemptions: int = 0
    # Per new token when logprobs were asked: {token_id: logprob} and the chosen one's rank.
    logprobs: Optional[list[dict[int, float]]] = None
    logprob_ranks: Optional[list[int]] = None
    error: Optional[str] = None
