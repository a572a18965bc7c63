"""Everything that crosses an actor boundary, as msgspec Structs.

The driver encodes each StepPlan once (msgpack) and puts the bytes in the object store; every
stage decodes the same bytes: that is the broadcast of new_token_ids. Nothing here carries a
row index: rows are rank-local, so requests are named by id and incarnation only.

Every struct is plain data (no struct refers back to its holder), so none is tracked by the
cyclic garbage collector (gc=False): a step builds and decodes hundreds of them per rank, and
tracked ones cost twice the time and trigger the collector's passes mid-step.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Optional

import msgspec

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


def _index(i: int, n: int) -> int:
    """i as a list index does it (negative from the end), or IndexError."""
    j = i + n if i < 0 else i
    if not 0 <= j < n:
        raise IndexError(f"index {i} out of range for {n} requests")
    return j


class CachedRequest(msgspec.Struct, frozen=True, gc=False):
    """One entry of a CachedRequestData, as a record: what update() of one row takes, and
    what tests build plans from. Not sent as such: plans carry the columns."""

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


class CachedRequestData(msgspec.Struct, array_like=True, gc=False):
    """The requests already in the ranks' batches, only what changed since the last plan
    naming each, as columns (vLLM's CachedRequestData shape): entry i of every per-request
    list belongs to req_ids[i]. Tokens, blocks and drafts are flattened: request i's are the
    next num_new_tokens[i] (num_new_blocks[i], num_drafts[i]) entries of the flat list.

    Columns, not a struct per request: a rank decodes them into a few lists and reads them
    as arrays, with no Python work per request on the common path (a decode step's one
    token). Entry i as a record: cached[i]; all of them: iter(cached)."""

    req_ids: list[str] = []
    token_starts: list[int] = []
    num_new_tokens: list[int] = []
    new_token_ids: list[int] = []
    num_computed_tokens: list[int] = []
    num_new_blocks: list[int] = []
    new_block_ids: list[int] = []
    block_starts: list[int] = []  # -1: append after the row's blocks
    num_drafts: list[int] = []
    draft_token_ids: list[int] = []
    self_drafted: list[bool] = []

    @classmethod
    def of(cls, entries) -> "CachedRequestData":
        out = cls([], [], [], [], [], [], [], [], [], [], [])
        for e in entries:
            out.append(e.req_id, e.token_start, e.new_token_ids, e.new_block_ids,
                       e.num_computed_tokens, e.block_start, e.draft_token_ids, e.self_drafted)
        return out

    def append(self, req_id: str, token_start: int, new_token_ids: list[int],
               new_block_ids: list[int], num_computed_tokens: int, block_start: Optional[int],
               draft_token_ids: list[int], self_drafted: bool) -> None:
        """One more request (the scheduler's builder: each column grows by its entry)."""
        self.req_ids.append(req_id)
        self.token_starts.append(token_start)
        self.num_new_tokens.append(len(new_token_ids))
        self.new_token_ids.extend(new_token_ids)
        self.num_computed_tokens.append(num_computed_tokens)
        self.num_new_blocks.append(len(new_block_ids))
        self.new_block_ids.extend(new_block_ids)
        self.block_starts.append(-1 if block_start is None else block_start)
        self.num_drafts.append(len(draft_token_ids))
        self.draft_token_ids.extend(draft_token_ids)
        self.self_drafted.append(self_drafted)

    def __len__(self) -> int:
        return len(self.req_ids)

    def __iter__(self):
        return iter(self.records())

    def __getitem__(self, i):
        return self.records()[i] if isinstance(i, slice) else self.records([_index(i, len(self))])[0]

    def records(self, which=None) -> list[CachedRequest]:
        """Entries `which` (indices, ascending; all by default) as records."""
        tok = list(accumulate(self.num_new_tokens, initial=0))
        blk = list(accumulate(self.num_new_blocks, initial=0))
        dra = list(accumulate(self.num_drafts, initial=0))
        out = []
        for i in (range(len(self.req_ids)) if which is None else which):
            start = self.block_starts[i]
            out.append(CachedRequest(
                self.req_ids[i], self.token_starts[i], self.new_token_ids[tok[i]:tok[i + 1]],
                self.new_block_ids[blk[i]:blk[i + 1]], self.num_computed_tokens[i],
                None if start < 0 else start, self.draft_token_ids[dra[i]:dra[i + 1]],
                self.self_drafted[i]))
        return out

    def check(self) -> None:
        """Every column has one entry per request, and each flat list the sum of its counts."""
        n = len(self.req_ids)
        for name in ("token_starts", "num_new_tokens", "num_computed_tokens", "num_new_blocks",
                     "block_starts", "num_drafts", "self_drafted"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"CachedRequestData.{name}: {len(getattr(self, name))} "
                                 f"entries for {n} requests")
        for name in ("num_new_tokens", "num_new_blocks", "num_drafts"):
            if n and min(getattr(self, name)) < 0:
                raise ValueError(f"CachedRequestData.{name}: a negative count")
        if n and min(self.block_starts) < -1:
            raise ValueError("CachedRequestData.block_starts: below -1 (-1: append)")
        for flat, counts in (("new_token_ids", "num_new_tokens"), ("new_block_ids", "num_new_blocks"),
                             ("draft_token_ids", "num_drafts")):
            if len(getattr(self, flat)) != sum(getattr(self, counts)):
                raise ValueError(f"CachedRequestData.{flat}: {len(getattr(self, flat))} "
                                 f"entries, {counts} sums to {sum(getattr(self, counts))}")


class StepPlan(msgspec.Struct, array_like=True, gc=False):
    step_id: int
    removed_req_ids: list[str]  # finished, aborted or preempted since the previous plan
    new_reqs: list[NewRequestData]
    cached_reqs: CachedRequestData
    # The order in which this step's tokens are laid out, and how many each request runs:
    # the cached requests in their order, then the new ones in theirs (`check`).
    scheduled_req_ids: list[str]
    num_scheduled_tokens: list[int]

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


class RowDigest(msgspec.Struct, frozen=True, gc=False):
    """One rank's bookkeeping for one request, right after it applied a plan, over the
    prefix the driver has told it about (see ray_runtime/digest.py): one entry of a
    RowDigests, as a record."""

    req_id: str
    incarnation: int
    num_tokens_known: int  # the row's own counter
    hash_length: int  # the driver's count of known tokens, as the plan stated it
    num_computed_tokens: int
    token_hash: int  # over token_ids[:hash_length + num_draft_tokens] as the row holds them
    num_conflicts: int  # driver tokens that disagreed with what the row already held
    num_draft_tokens: int = 0  # drafts the row holds after the known prefix


class RowDigests(msgspec.Struct, array_like=True, gc=False):
    """One rank's digests of the requests a step ran, as columns: entry i of every list is
    req_ids[i]'s (the fields of RowDigest). Entry i as a record: digests[i]."""

    req_ids: list[str] = []
    incarnation: list[int] = []
    num_tokens_known: list[int] = []
    hash_length: list[int] = []
    num_computed_tokens: list[int] = []
    token_hash: list[int] = []
    num_conflicts: list[int] = []
    num_draft_tokens: list[int] = []

    @classmethod
    def of(cls, records) -> "RowDigests":
        cols = list(zip(*(msgspec.structs.astuple(r) for r in records)))
        return cls(*(list(c) for c in cols)) if cols else cls()

    def __len__(self) -> int:
        return len(self.req_ids)

    def __iter__(self):
        return iter(self.records())

    def __getitem__(self, i):
        return self.records()[i] if isinstance(i, slice) else self.records([_index(i, len(self))])[0]

    def check(self) -> None:
        """One entry per request in every column (the audit reads them side by side)."""
        n = len(self.req_ids)
        for name, column in zip(self.__struct_fields__, msgspec.structs.astuple(self)):
            if len(column) != n:
                raise ValueError(f"RowDigests.{name}: {len(column)} entries for {n} requests")

    def records(self, which=None) -> list[RowDigest]:
        """Entries `which` (indices; all by default) as records."""
        cols = msgspec.structs.astuple(self)
        idx = range(len(self.req_ids)) if which is None else which
        return [RowDigest(*(c[i] for c in cols)) for i in idx]


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
