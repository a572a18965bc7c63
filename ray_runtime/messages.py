"""Everything that crosses an actor boundary, as msgspec Structs.

The driver encodes each StepPlan once (msgpack) and puts the bytes in the object store; every
stage decodes the same bytes: that is the broadcast of new_token_ids. Nothing here carries a
row index: rows are rank-local, so requests are named by id and incarnation only.

Every struct is plain data (no struct refers back to its holder), so none is tracked by the
cyclic garbage collector (gc=False): a step builds and decodes hundreds of them per rank, and
tracked ones cost twice the time and trigger the collector's passes mid-step.
"""
from __future__ import annotations

from typing import Optional

import msgspec

from ray_runtime.columns import (CachedRequest, CachedRequestData, RowDigest,  # noqa: F401
                                 RowDigests)
from ray_runtime.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True, gc=False):
    """A request entering the ranks' batches: first scheduling, or resumption after preemption."""

    req_id: str
    incarnation: int  # bumped by the driver on every (re)admission; late results of older ones are dropped
    token_ids: list[int]  # the whole known prefix: prompt + every committed output token
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose KV is already valid in block_ids (0 here: no prefix cache)
    block_ids: list[int]
    sampling: SamplingParams


class StepPlan(msgspec.Struct, array_like=True, gc=False):
    step_id: int
    removed_req_ids: list[str]  # finished, aborted or preempted since the previous plan
    new_reqs: list[NewRequestData]
    cached_reqs: CachedRequestData
    # The order in which this step's tokens are laid out, and how many each request runs:
    # the cached requests in their order, then the new ones in theirs (`check`).
    scheduled_req_ids: list[str]
    num_scheduled_tokens: list[int]
    # fewer than half of its tokens get logits (a prompt's chunks, not decode rows or drafts):
    # every rank runs the prefill split's blocks (ray_runtime/layer_span.py)
    prefill_shaped: bool = False

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def check_layout(self) -> None:
        """The layout order is the cached requests', then the new ones' (a rank reads each
        request's entry by its place in the step, without a lookup by id): cheap enough for
        every step (InputBatch.apply_plan)."""
        order = self.cached_reqs.req_ids + [n.req_id for n in self.new_reqs]
        if self.scheduled_req_ids != order:
            raise ValueError(f"step {self.step_id}: scheduled_req_ids {self.scheduled_req_ids} "
                             f"are not the cached requests then the new ones {order}")
        if len(self.num_scheduled_tokens) != len(order):
            raise ValueError(f"step {self.step_id}: {len(self.num_scheduled_tokens)} "
                             f"num_scheduled_tokens for {len(order)} requests")

    def check(self) -> None:
        """check_layout, every column's length and counts, and no request named twice
        (tests, and every step under debug_checks)."""
        self.check_layout()
        self.cached_reqs.check()
        if len(set(self.scheduled_req_ids)) != len(self.scheduled_req_ids):
            raise ValueError(f"step {self.step_id}: a request named twice in "
                             f"{self.scheduled_req_ids}")


class SamplerOutput(msgspec.Struct, array_like=True, gc=False):
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


class StageTiming(msgspec.Struct, array_like=True, gc=False):
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
    # rank 0 with token feedback: the newest step whose fed-back samples this step waited for
    # (the device waits on CUDA); -1 when it embedded none still in flight
    fed_from_step: int = -1
    # RAY_RUNTIME_PHASE_CLOCK (stages/profiling.py): the stage's cumulative host time per
    # phase so far, {name: (count, seconds)}; None when the clock is off
    phases: Optional[dict[str, tuple[int, float]]] = None
    # with the phase clock on CUDA: the device spans (step id, start, end; time.time()
    # seconds) of this stage's steps that completed since its previous reply
    gpu_spans: Optional[list[tuple[int, float, float]]] = None


class StageStepResult(msgspec.Struct, array_like=True, gc=False):
    """What every stage returns for a step: timings and digests on every rank, the sampler
    output on the last rank."""

    step_id: int
    rank: int
    timing: StageTiming
    digests: RowDigests
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


class RequestSpec(msgspec.Struct, array_like=True, gc=False):
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
