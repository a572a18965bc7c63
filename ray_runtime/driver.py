"""The driver actor: owns the scheduler and the stage actors, and runs the step loop.

The driver's Request objects are the canonical state of every request; stages hold copies
that plans keep up to date by deltas. Each plan is encoded once with msgspec and the same
bytes are written to every stage's channel (ray_runtime/channel.py); replies are read back in
plan order. No Ray call and no `ray.get` sits in the step loop.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from typing import Optional

import ray
from ray.util.placement_group import remove_placement_group

from ray_runtime.channel import ERROR, PLAN, STOP, ChannelClosed, StageError
from ray_runtime.cluster import create_placement_group, open_channels, start_stages
from ray_runtime.config import EngineConfig, stage_layer_ranges
from ray_runtime.messages import FinishedRequest, RequestSpec, StageStepResult, decode_result, encode
from ray_runtime.metrics import EngineMetrics
from ray_runtime.reconcile import BookkeepingMismatch, audit
from ray_runtime.request import Request
from ray_runtime.scheduler import PlanRecord, Scheduler
from ray_runtime.trace import PipelineTrace
from stages.model_spec import ModelSpec

logger = logging.getLogger(__name__)
DRAIN_TIMEOUT_S = 30.0  # after a failed step: how long the other stages get to answer


def resolve_max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    if config.max_model_len is None:
        return spec.max_position_embeddings
    if config.max_model_len > spec.max_position_embeddings:
        raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's "
                         f"max_position_embeddings ({spec.max_position_embeddings})")
    return config.max_model_len


class Driver:
    def __init__(self, config: EngineConfig, engine_id: Optional[str] = None) -> None:
        logging.basicConfig(level=logging.INFO)
        self.config = config
        # Names the actors (ray_runtime/cluster.py) and tags the metrics.
        self.engine_id = engine_id or uuid.uuid4().hex[:8]
        self.spec = ModelSpec.from_dir(config.model)
        self.max_model_len = resolve_max_model_len(config, self.spec)
        layer_ranges = stage_layer_ranges(self.spec.num_layers, config.pipeline_parallel_size,
                                          config.pp_layer_partition)
        self.pg = create_placement_group(config)
        self.stages, self.stage_placement = start_stages(
            config, self.pg, layer_ranges, self.max_model_len, engine_id=self.engine_id)
        self.num_kv_blocks = self._size_kv_pool()
        ray.get([s.init_kv_cache.remote(self.num_kv_blocks) for s in self.stages])
        self.channels = open_channels(self.stages)
        self._broken: Optional[str] = None  # why the engine cannot step any more
        pp = config.pipeline_parallel_size
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            num_kv_blocks=self.num_kv_blocks, block_size=config.block_size,
            max_model_len=self.max_model_len,
            allow_placeholders=config.async_scheduling and pp == 1,
            num_speculative_tokens=config.num_speculative_tokens)
        # PP>1: one plan per stage keeps every stage busy (the last stage, which samples, is
        # the slowest; a request's next step waits for its token anyway). PP=1: the next plan
        # waits behind the running one and computes on its pending sample.
        self.max_inflight = config.inflight_steps
        self._inflight: deque[PlanRecord] = deque()  # launched, replies not yet read
        self.eos_token_ids = frozenset(self.spec.eos_token_ids)
        self.trace = PipelineTrace(pp, record_events=config.trace_file is not None)
        self._arrivals = 0
        self._num_requests_finished = 0
        self._num_prompt_tokens = 0
        self._num_mismatches = 0
        self._digest_s = [0.0] * pp
        self._gpu_busy_s = [0.0] * pp  # CUDA: device span of each stage's steps
        self._audit_s = 0.0
        self._plan_s = 0.0
        self._wait_s = 0.0
        self._mismatches_by_rank = [0] * pp
        # ray.util.metrics, fed in batches (ray_runtime/metrics.py); None: disable_log_stats
        self.metrics: Optional[EngineMetrics] = None if config.disable_log_stats else \
            EngineMetrics(config.model, self.engine_id, pp, self._metric_totals)

    def __repr__(self) -> str:
        """Ray shows it on the dashboard's Actors page and before this actor's log lines."""
        c = getattr(self, "config", None)
        if c is None:
            return "Driver()"
        return f"Driver(engine={self.engine_id}, pp={c.pipeline_parallel_size}, model={c.model})"

    def _size_kv_pool(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        useful = self.config.max_num_seqs * -(-self.max_model_len // self.config.block_size)
        capacity = min(ray.get([s.kv_block_capacity.remote() for s in self.stages]))
        return max(1, min(capacity, useful))

    def info(self) -> dict:
        return {"vocab_size": self.spec.vocab_size, "max_model_len": self.max_model_len,
                "num_kv_blocks": self.num_kv_blocks, "block_size": self.config.block_size,
                "eos_token_ids": list(self.spec.eos_token_ids),
                "num_layers": self.spec.num_layers, "engine_id": self.engine_id}

    # ---- serving -------------------------------------------------------------------------
    def generate(self, requests: list[RequestSpec]) -> list[FinishedRequest]:
        if self._broken is not None:
            raise RuntimeError(f"the engine cannot run any more ({self._broken}); shut it down "
                               "and create a new LLM")
        sched = self.scheduler
        m = self.metrics
        if m is not None:
            m.on_arrivals([spec.req_id for spec in requests], time.time())
        for spec in requests:
            sched.add_request(Request(spec.req_id, spec.prompt_token_ids, spec.sampling,
                                      self.eos_token_ids, self._arrivals))
            self._arrivals += 1
            self._num_prompt_tokens += len(spec.prompt_token_ids)
        finished: list[FinishedRequest] = []
        self.trace.reset_window()
        try:
            while sched.has_unfinished() or self._inflight:
                self._fill_pipeline()
                if not self._inflight:
                    raise RuntimeError("scheduler has unfinished requests but planned nothing")
                if m is not None:  # the pipeline is full: a flush overlaps the stages' work
                    m.maybe_flush()
                self._complete_oldest()
                finished.extend(self._collect(sched.pop_finished()))
        except BaseException as e:
            if isinstance(e, (ChannelClosed, TimeoutError)):
                self._broken = str(e)  # replies are out of step with plans: no draining
                self._inflight.clear()
            self._abandon(requests)
            raise
        finally:
            if m is not None:
                m.flush()
        if self.config.trace_file:
            self.trace.write(self.config.trace_file)
        return finished

    def _abandon(self, requests: list[RequestSpec]) -> None:
        """After a failed call, leave the engine ready for the next one: this call's requests
        are aborted (their slots leave the ranks with the next plan) and in-flight steps are
        drained, their replies dropped. A stage that does not answer within the drain
        deadline leaves the engine unusable, said clearly on the next call."""
        for spec in requests:
            self.scheduler.abort_request(spec.req_id)
        while self._inflight:
            self._inflight.popleft()
            for chan in self.channels:
                try:
                    chan.recv(timeout_s=min(self.config.step_timeout_s, DRAIN_TIMEOUT_S))
                except (TimeoutError, ChannelClosed) as e:
                    self._broken = str(e)
        from ray_runtime.link import reset_link  # a failed step leaves the link out of step
        self._broken = reset_link(self.stages, self.config, self._broken)
        aborted = self.scheduler.pop_finished()
        if self.metrics is not None:
            self.metrics.on_finished(aborted, time.time())

    def _fill_pipeline(self) -> None:
        """Plan and launch steps until max_inflight are out or nothing more can run now:
        the driver never waits on a stage while it could plan."""
        while len(self._inflight) < self.max_inflight:
            t0 = time.time()
            record = self.scheduler.schedule()
            if record is None:
                break
            plan = encode(record.plan)  # once; every stage reads the same bytes
            for chan in self.channels:
                chan.send(PLAN, plan)
            self._inflight.append(record)
            t1 = time.time()
            self._plan_s += t1 - t0
            if self.metrics is not None:
                self.metrics.on_plan(record.plan, self.scheduler.num_scheduled_tokens_total, t1)
            self.trace.driver_span("plan", t0, t1, step=record.plan.step_id,
                                   reqs=len(record.plan.scheduled_req_ids))

    def _read_replies(self) -> list[StageStepResult]:
        """The oldest step's reply from every stage, in rank order."""
        results, errors = [], []
        for chan in self.channels:
            kind, payload = chan.recv(timeout_s=self.config.step_timeout_s)
            if kind == ERROR:
                errors.append(payload.decode())
            else:
                results.append(decode_result(payload))
        if errors:
            raise StageError("\n".join(errors))
        return results

    def _complete_oldest(self) -> None:
        record = self._inflight.popleft()
        t0 = time.time()
        results = self._read_replies()
        t1 = time.time()
        self._wait_s += t1 - t0
        self.trace.driver_span("wait", t0, t1, step=record.plan.step_id)
        discard = self._reconcile(record, results)
        t2 = time.time()
        self._audit_s += t2 - t1
        self.trace.driver_span("reconcile", t1, t2, step=record.plan.step_id)
        self.scheduler.update_from_output(record, results[-1].sampler_output, discard)
        for req_id in discard:
            self.scheduler.preempt(req_id)  # recomputed from the driver's tokens
        if self.config.debug_checks:
            self.scheduler.check()
        t3 = time.time()
        if self.metrics is not None:
            self.metrics.on_step(results, self.scheduler.requests, t3)
        self.trace.driver_span("output", t2, t3, step=record.plan.step_id)

    def _reconcile(self, record: PlanRecord, results: list[StageStepResult]) -> frozenset[str]:
        """Audit every rank's digests; repair by recompute, or raise."""
        bad: set[str] = set()
        last = self.config.pipeline_parallel_size - 1
        for res in results:
            self.trace.stage_step(res.rank, res.step_id, res.timing)
            self._digest_s[res.rank] += res.timing.digest_s
            self._gpu_busy_s[res.rank] += res.timing.gpu_busy_s
            digests = res.digests
            if record.self_drafted:  # uncorrected self-drafted steps are not audited
                digests = [d for d in digests if d.req_id not in record.self_drafted]
            for m in audit(record.expected, digests, res.rank, res.rank == last):
                self._num_mismatches += 1
                self._mismatches_by_rank[res.rank] += 1
                logger.warning("%s (step %d)", m, record.plan.step_id)
                if self.config.on_mismatch == "raise":
                    raise BookkeepingMismatch(f"{m} (step {record.plan.step_id})")
                bad.add(m.req_id)
        return frozenset(bad)

    def _collect(self, done: list[Request]) -> list[FinishedRequest]:
        out = []
        if done and self.metrics is not None:
            self.metrics.on_finished(done, time.time())
        for req in done:
            self._num_requests_finished += 1
            lps = ranks = None
            if req.sampling.logprobs is not None:
                lps = [d for d, _ in req.logprobs]
                ranks = [r for _, r in req.logprobs]
            out.append(FinishedRequest(
                req_id=req.req_id, prompt_token_ids=req.token_ids[:req.num_prompt_tokens],
                output_token_ids=req.output_token_ids, finish_reason=req.finish_reason,
                stop_reason=req.stop_reason, num_preemptions=req.num_preemptions,
                logprobs=lps, logprob_ranks=ranks))
        return out

    def stats(self) -> dict:
        s, t = self.scheduler, self.trace
        return {"num_steps": s.num_steps, "num_preemptions": s.num_preemptions,
                "num_generated_tokens": s.num_generated_tokens,
                "num_prompt_tokens": self._num_prompt_tokens,
                "num_scheduled_tokens": s.num_scheduled_tokens_total,
                "num_placeholder_tokens": s.num_placeholder_tokens,
                "num_dropped_samples": s.num_dropped_samples,
                "num_requests_finished": self._num_requests_finished,
                "num_kv_blocks": self.num_kv_blocks, "num_free_kv_blocks": s.blocks.num_free_blocks,
                "bookkeeping_mismatches": self._num_mismatches,
                "spec_num_drafts": s.spec_num_drafts,
                "spec_num_draft_tokens": s.spec_num_draft_tokens,
                "spec_num_accepted_tokens": s.spec_num_accepted_tokens,
                "spec_num_accepted_tokens_per_pos": list(s.spec_num_accepted_tokens_per_pos),
                "spec_acceptance_rate": (s.spec_num_accepted_tokens / s.spec_num_draft_tokens
                                         if s.spec_num_draft_tokens else None),
                "spec_num_rolled_back_blocks": s.num_rolled_back_blocks,
                "async_scheduling": self.config.async_scheduling,
                "driver_plan_s": self._plan_s, "driver_wait_s": self._wait_s,
                "driver_audit_s": self._audit_s, "stage_digest_s": list(self._digest_s),
                "stage_busy_s": list(t.busy_s),
                "stage_gpu_busy_s": list(self._gpu_busy_s) if self.config.device == "cuda" else None, "stage_idle_s": list(t.idle_s),
                "stage_idle_fraction": t.idle_fractions(),
                # where each stage runs: rank, layers, node id and address, pid, GPU ids
                "stage_placement": [dict(p) for p in self.stage_placement]}

    def _metric_totals(self) -> dict:
        """The cumulative counts and current gauges that metrics flush records (the same
        numbers as stats())."""
        s, t = self.scheduler, self.trace
        return {"prompt_tokens": self._num_prompt_tokens,
                "generation_tokens": s.num_generated_tokens,
                "num_preemptions": s.num_preemptions,
                "spec_decode_num_drafts": s.spec_num_drafts,
                "spec_decode_num_draft_tokens": s.spec_num_draft_tokens,
                "spec_decode_num_accepted_tokens": s.spec_num_accepted_tokens,
                "num_requests_running": len(s.running), "num_requests_waiting": len(s.waiting),
                "kv_cache_usage_perc": 1.0 - s.blocks.num_free_blocks / self.num_kv_blocks,
                "stage_busy_s": t.busy_s, "stage_idle_s": t.idle_s,
                "stage_digest_s": self._digest_s, "stage_gpu_busy_s": self._gpu_busy_s,
                "bookkeeping_mismatches": self._mismatches_by_rank}

    def metrics_snapshot(self) -> Optional[dict]:
        """Tests only: what the metrics recorded (ray_runtime/metrics.py, snapshot()), or
        None with disable_log_stats."""
        return None if self.metrics is None else self.metrics.snapshot()

    def check(self) -> None:
        self.scheduler.check()
        ray.get([s.check.remote() for s in self.stages])

    def set_fault_hook(self, rank: int, hook) -> None:
        ray.get(self.stages[rank].set_fault_hook.remote(hook))

    def shutdown(self) -> None:
        for chan in self.channels:
            try:
                chan.send(STOP)
            except ChannelClosed:
                pass
            chan.close()
        try:
            ray.get([s.close.remote() for s in self.stages], timeout=30)
        finally:
            for s in self.stages:
                ray.kill(s)
            remove_placement_group(self.pg)
