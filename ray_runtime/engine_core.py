"""The engine core: one step of the loop, independent of how requests arrive.

    schedule -> launch on the ranks -> read the oldest step's replies -> audit -> commit
    -> report what changed

The driver actor runs it continuously (ray_runtime/engine_loop.py); tests and benchmarks
drive the same object in process over `LocalRanks` (ray_runtime/ranks.py). Requests come in
through `add_request` and `abort`, and leave as RequestDeltas from `step`.

The driver's Request objects are the canonical state of every request; the ranks hold copies
that plans keep up to date by deltas. Each plan is encoded once and the same bytes go to every
rank; replies are read in plan order.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, Optional

from ray_runtime.channel import ChannelClosed
from ray_runtime.config import EngineConfig
from ray_runtime.messages import RequestDelta, RequestSpec, StageStepResult, encode
from ray_runtime.metrics import EngineMetrics
from ray_runtime.ranks import RankLink
from ray_runtime.reconcile import BookkeepingMismatch, audit
from ray_runtime.request import Request
from ray_runtime.sampling_params import RequestOutputKind
from ray_runtime.plan_record import PlanRecord
from ray_runtime.scheduler import Scheduler
from ray_runtime.trace import PipelineTrace

logger = logging.getLogger(__name__)

_FINAL_ONLY = RequestOutputKind.FINAL_ONLY
# Steps failing in a row (a rank that reports an error at every step, e.g. a sticky device
# error) after which the ranks count as lost and are replaced.
MAX_FAILED_STEPS = 3


def streams(spec_sampling) -> bool:
    """Whether a request reports its tokens as they come: any output kind but FINAL_ONLY,
    and every request with stop strings (the caller detokenizes and checks them)."""
    return spec_sampling.output_kind != _FINAL_ONLY or bool(spec_sampling.stop)


class EngineCore:
    def __init__(self, config: EngineConfig, ranks: RankLink, *, num_kv_blocks: int,
                 max_model_len: int, eos_token_ids, engine_id: str = "local",
                 replace_ranks: Optional[Callable[[BaseException], RankLink]] = None,
                 reset_link: Optional[Callable[[], Optional[str]]] = None) -> None:
        self.config = config
        self.ranks = ranks
        self.num_kv_blocks = num_kv_blocks
        pp = config.pipeline_parallel_size
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            num_kv_blocks=num_kv_blocks, block_size=config.block_size,
            max_model_len=max_model_len,
            allow_placeholders=config.async_scheduling and (pp == 1 or config.feeds_tokens_back),
            num_speculative_tokens=config.num_speculative_tokens,
            num_lanes=config.num_microbatches)
        # PP=1: the next plan waits behind the running one and computes on its pending
        # sample. PP>1 with token feedback: two plans per micro-batch (the running one, and
        # the next on its pending samples). PP>1 with drafts: one plan per stage.
        self.max_inflight = config.inflight_steps
        # Ranks that may know a request's samples before the driver does (the audit lets
        # their known counter run ahead): the last rank, which samples, and rank 0 when the
        # samples feed back to it directly.
        self.ahead_ranks = frozenset({pp - 1, 0} if config.feeds_tokens_back else {pp - 1})
        self._inflight: deque[PlanRecord] = deque()  # launched, replies not yet read
        self.eos_token_ids = frozenset(eos_token_ids)
        self.trace = PipelineTrace(pp, record_events=config.trace_file is not None)
        # ray.util.metrics, fed in batches (ray_runtime/metrics.py); None: disable_log_stats
        self.metrics: Optional[EngineMetrics] = None if config.disable_log_stats else \
            EngineMetrics(config.model, engine_id, pp, self.metric_totals)
        # Requests that report each step's new tokens, and how many of their outputs each
        # has reported; the others report once, when they finish.
        self._streamed: dict[str, int] = {}
        self._arrivals = 0
        self.num_requests_finished = 0
        self.num_prompt_tokens = 0
        self.num_mismatches = 0
        self.mismatches_by_rank = [0] * pp
        self.digest_s = [0.0] * pp
        self.gpu_busy_s = [0.0] * pp  # CUDA: device span of each stage's steps
        self.audit_s = 0.0
        self.plan_s = 0.0
        self.wait_s = 0.0
        self.last_progress = time.monotonic()  # when a step last completed (check_health)
        # Stage recovery: a callable that tears the ranks down and returns new, empty ones.
        self.replace_ranks = replace_ranks
        # After a rank's error: re-form the inter-stage link (its transfers are out of step);
        # returns why it could not, or None (ray_runtime/link.py).
        self.reset_link = reset_link
        self.num_stage_restarts = 0
        self.recovering = False
        self.num_failed_steps = 0  # in a row, since the last step that completed
        self.recovery_s: list[float] = []  # how long each replacement took

    # ---- requests in ---------------------------------------------------------------------
    def add_request(self, spec: RequestSpec) -> None:
        if spec.req_id in self.scheduler.requests:
            raise ValueError(f"request_id {spec.req_id!r} is already running")
        self.scheduler.add_request(Request(spec.req_id, spec.prompt_token_ids, spec.sampling,
                                           self.eos_token_ids, self._arrivals))
        self._arrivals += 1
        self.num_prompt_tokens += len(spec.prompt_token_ids)
        if streams(spec.sampling):
            self._streamed[spec.req_id] = 0
        if self.metrics is not None:
            self.metrics.on_arrivals((spec.req_id,), time.time())

    def abort(self, req_ids) -> None:
        """Finish these requests now (finish_reason "abort"); unknown or finished ids are
        ignored. Their KV blocks are free at once; their rank slots leave with the next plan."""
        for req_id in req_ids:
            self.scheduler.abort_request(req_id)

    def has_work(self) -> bool:
        s = self.scheduler
        return s.has_unfinished() or bool(self._inflight) or s.has_finished()

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Fill the pipeline, complete the oldest step in flight, and report the requests
        it advanced or finished. On an exception nothing is reported; call `fail`."""
        sched = self.scheduler
        self._fill_pipeline()
        if self._inflight:
            if self.metrics is not None:  # the pipeline is full: a flush overlaps the ranks' work
                self.metrics.maybe_flush()
            advanced = self._complete_oldest()
        elif sched.has_unfinished():
            raise RuntimeError("scheduler has unfinished requests but planned nothing")
        else:
            advanced = ()
        return self._deltas(advanced, sched.pop_finished())

    def fail(self, error: BaseException) -> list[RequestDelta]:
        """After `step` raised. A lost rank (its channel closed, or silent past the step
        deadline) is replaced and every unfinished request recomputed from its tokens, up to
        max_stage_restarts times: nothing is reported, the requests go on. Otherwise every
        unfinished request ends with the error (reported to its caller), and the in-flight
        steps are drained (replies dropped) so that the engine is ready for new requests.
        A link that cannot be drained is `ranks.broken`."""
        sched = self.scheduler
        # Requests that finished (or were aborted) before the error are reported as such.
        finished_ok = self._deltas((), sched.pop_finished())
        self.num_failed_steps += 1
        not_recovered = self._recover(error)
        if not_recovered is None:
            return finished_ok
        msg = f"{type(error).__name__}: {error}{not_recovered}"
        failed = list(sched.requests)
        for req_id in failed:
            sched.abort_request(req_id)
        if self.ranks.broken is None:
            self.ranks.drain(len(self._inflight), broken=error)
        if self.ranks.broken is None and self.reset_link is not None:
            self.ranks.broken = self.reset_link()  # every plan is answered: no step runs
        self._inflight.clear()
        done = sched.pop_finished()
        if self.metrics is not None:
            self.metrics.on_finished(done, time.time())
        out = finished_ok
        for req in done:
            self._streamed.pop(req.req_id, None)
            out.append(RequestDelta(req.req_id, [], True, "abort", None, req.num_preemptions,
                                    error=msg))
        return out

    def _is_loss(self, error: BaseException) -> bool:
        """A rank is gone or stuck (its channel closed, or silent past the step deadline), or
        keeps failing (MAX_FAILED_STEPS steps in a row without one that completed), as
        opposed to a rank that reported an error once and goes on."""
        return isinstance(error, (ChannelClosed, TimeoutError)) or \
            self.num_failed_steps >= MAX_FAILED_STEPS

    def _recover(self, error: BaseException) -> Optional[str]:
        """Replace the ranks after a loss; None if done, else why not (for the message)."""
        if not self._is_loss(error) or self.replace_ranks is None:
            return ""
        if self.num_stage_restarts >= self.config.max_stage_restarts:
            logger.error("a stage was lost (%s) and max_stage_restarts=%d are spent", error,
                         self.config.max_stage_restarts)
            return (f" (a stage was lost and max_stage_restarts="
                    f"{self.config.max_stage_restarts} replacements are spent)")
        t0 = time.monotonic()
        logger.warning("a stage was lost (%s): replacing the stages, then recomputing the "
                       "unfinished requests", error)
        self.recovering = True  # health stays true while the stages are replaced
        self.last_progress = t0
        try:
            self.ranks = self.replace_ranks(error)
        except Exception as e:  # noqa: BLE001 - no stages to run on: the engine is done
            logger.exception("replacing the stages failed")
            self.ranks.broken = f"a stage was lost ({error}) and replacing it failed: {e}"
            return f" (a stage was lost and replacing it failed: {type(e).__name__}: {e})"
        finally:
            self.recovering = False
        self._inflight.clear()
        requeued = self.scheduler.requeue_all()
        self.num_failed_steps = 0
        self.num_stage_restarts += 1
        self.recovery_s.append(time.monotonic() - t0)
        self.last_progress = time.monotonic()
        logger.warning("stages replaced in %.2f s; %d requests recomputed (restart %d of %d)",
                       self.recovery_s[-1], requeued, self.num_stage_restarts,
                       self.config.max_stage_restarts)
        return None

    def _fill_pipeline(self) -> None:
        """Plan and launch steps until max_inflight are out or nothing more can run now:
        the driver never waits on a rank while it could plan."""
        while len(self._inflight) < self.max_inflight:
            t0 = time.time()
            record = self.scheduler.schedule()
            if record is None:
                break
            self.ranks.send_plan(encode(record.plan))  # encoded once for every rank
            self._inflight.append(record)
            t1 = time.time()
            self.plan_s += t1 - t0
            if self.metrics is not None:
                self.metrics.on_plan(record.plan, self.scheduler.num_scheduled_tokens_total, t1)
            if self.trace.record_events:
                self.trace.driver_span("plan", t0, t1, step=record.plan.step_id,
                                       reqs=len(record.plan.scheduled_req_ids),
                                       tokens=record.plan.total_num_scheduled_tokens,
                                       prompt_tokens=self._prompt_tokens(record.plan),
                                       prefill_shaped=record.plan.prefill_shaped)

    def _prompt_tokens(self, plan) -> int:
        """How many of a just-made plan's tokens are prompt tokens (for the trace)."""
        requests, total = self.scheduler.requests, 0
        for req_id, n in zip(plan.scheduled_req_ids, plan.num_scheduled_tokens):
            req = requests[req_id]
            end = req.num_computed_tokens  # moved past this plan's tokens by planning it
            total += max(0, min(req.num_prompt_tokens, end) - (end - n))
        return total

    def _complete_oldest(self) -> list[str]:
        """Read, audit and commit the oldest step; the ids it sampled for."""
        record = self._inflight.popleft()
        t0 = time.time()
        results = self.ranks.read_replies(record.plan.step_id)
        t1 = time.time()
        self.wait_s += t1 - t0
        self.trace.driver_span("wait", t0, t1, step=record.plan.step_id)
        discard = self._reconcile(record, results)
        t2 = time.time()
        self.audit_s += t2 - t1
        self.trace.driver_span("reconcile", t1, t2, step=record.plan.step_id)
        out = results[-1].sampler_output
        self.scheduler.update_from_output(record, out, discard)
        for req_id in discard:
            self.scheduler.preempt(req_id)  # recomputed from the driver's tokens
        if self.config.debug_checks:
            self.scheduler.check()
        t3 = time.time()
        if self.metrics is not None:
            self.metrics.on_step(results, self.scheduler.requests, t3)
        self.trace.driver_span("output", t2, t3, step=record.plan.step_id)
        self.last_progress = time.monotonic()
        self.num_failed_steps = 0
        return out.req_ids

    def _reconcile(self, record: PlanRecord, results: list[StageStepResult]) -> frozenset[str]:
        """Audit every rank's digests; repair by recompute, or raise."""
        bad: set[str] = set()
        ahead = self.ahead_ranks
        for res in results:
            self.trace.stage_step(res.rank, res.step_id, res.timing)
            self.digest_s[res.rank] += res.timing.digest_s
            self.gpu_busy_s[res.rank] += res.timing.gpu_busy_s
            # uncorrected self-drafted steps are not audited
            for m in audit(record.expected, res.digests, res.rank, res.rank in ahead,
                           record.self_drafted):
                self.num_mismatches += 1
                self.mismatches_by_rank[res.rank] += 1
                logger.warning("%s (step %d)", m, record.plan.step_id)
                if self.config.on_mismatch == "raise":
                    raise BookkeepingMismatch(f"{m} (step {record.plan.step_id})")
                bad.add(m.req_id)
        return frozenset(bad)

    # ---- what changed --------------------------------------------------------------------
    def _deltas(self, advanced, done: list[Request]) -> list[RequestDelta]:
        out: list[RequestDelta] = []
        streamed = self._streamed
        if streamed and advanced:
            requests = self.scheduler.requests
            for req_id in advanced:
                sent = streamed.get(req_id)
                if sent is None:
                    continue
                req = requests.get(req_id)
                if req is not None and req.num_output_tokens > sent:
                    out.append(self._delta(req, sent))
                    streamed[req_id] = req.num_output_tokens
        if done:
            if self.metrics is not None:
                self.metrics.on_finished(done, time.time())
            self.num_requests_finished += len(done)
            for req in done:
                out.append(self._delta(req, streamed.pop(req.req_id, 0)))
        return out

    @staticmethod
    def _delta(req: Request, start: int) -> RequestDelta:
        lps = ranks = None
        if req.sampling.logprobs is not None:
            lps = [d for d, _ in req.logprobs[start:]]
            ranks = [r for _, r in req.logprobs[start:]]
        return RequestDelta(req.req_id, req.token_ids[req.num_prompt_tokens + start:],
                            req.is_finished, req.finish_reason, req.stop_reason,
                            req.num_preemptions, lps, ranks)

    def rank_view(self) -> Optional[set[str]]:
        """The requests every rank must hold a slot for now: running ones, and those removed
        since the last plan (they leave with the next one). None while steps are in flight
        (the ranks may be mid-step)."""
        if self._inflight:
            return None
        s = self.scheduler
        return {r.req_id for r in s.running} | set(s.pending_removals)

    # ---- bookkeeping ---------------------------------------------------------------------
    def stats(self) -> dict:
        s, t = self.scheduler, self.trace
        return {"num_steps": s.num_steps, "num_preemptions": s.num_preemptions,
                "num_generated_tokens": s.num_generated_tokens,
                "num_prompt_tokens": self.num_prompt_tokens,
                "num_scheduled_tokens": s.num_scheduled_tokens_total,
                "num_placeholder_tokens": s.num_placeholder_tokens,
                "num_dropped_samples": s.num_dropped_samples,
                "num_requests_finished": self.num_requests_finished,
                "num_requests_running": len(s.running), "num_requests_waiting": len(s.waiting),
                "num_kv_blocks": self.num_kv_blocks, "num_free_kv_blocks": s.blocks.num_free_blocks,
                "bookkeeping_mismatches": self.num_mismatches,
                "spec_num_drafts": s.spec_num_drafts,
                "spec_num_draft_tokens": s.spec_num_draft_tokens,
                "spec_num_accepted_tokens": s.spec_num_accepted_tokens,
                "spec_num_accepted_tokens_per_pos": list(s.spec_num_accepted_tokens_per_pos),
                "spec_acceptance_rate": (s.spec_num_accepted_tokens / s.spec_num_draft_tokens
                                         if s.spec_num_draft_tokens else None),
                "spec_num_rolled_back_blocks": s.num_rolled_back_blocks,
                "async_scheduling": self.config.async_scheduling,
                "num_stage_restarts": self.num_stage_restarts,
                "stage_recovery_s": list(self.recovery_s),
                "driver_plan_s": self.plan_s, "driver_wait_s": self.wait_s,
                "driver_audit_s": self.audit_s, "stage_digest_s": list(self.digest_s),
                "stage_busy_s": list(t.busy_s),
                "stage_gpu_busy_s": list(self.gpu_busy_s) if self.config.device == "cuda" else None,
                "stage_idle_s": list(t.idle_s), "stage_idle_fraction": t.idle_fractions(),
                "stage_launch_s": list(t.launch_s), "stage_steps": list(t.steps),
                "stage_phase_s": [None if p is None else {k: list(v) for k, v in p.items()}
                                  for p in t.phases]}

    def metric_totals(self) -> dict:
        """The cumulative counts and current gauges that a metrics flush records (the same
        numbers as stats())."""
        s, t = self.scheduler, self.trace
        return {"prompt_tokens": self.num_prompt_tokens,
                "generation_tokens": s.num_generated_tokens,
                "num_preemptions": s.num_preemptions,
                "spec_decode_num_drafts": s.spec_num_drafts,
                "spec_decode_num_draft_tokens": s.spec_num_draft_tokens,
                "spec_decode_num_accepted_tokens": s.spec_num_accepted_tokens,
                "num_requests_running": len(s.running), "num_requests_waiting": len(s.waiting),
                "kv_cache_usage_perc": 1.0 - s.blocks.num_free_blocks / self.num_kv_blocks,
                "stage_busy_s": t.busy_s, "stage_idle_s": t.idle_s,
                "stage_digest_s": self.digest_s, "stage_gpu_busy_s": self.gpu_busy_s,
                "bookkeeping_mismatches": self.mismatches_by_rank}
