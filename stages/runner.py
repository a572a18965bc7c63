"""The stage runner: apply a plan to the rank-local batch, build this step's inputs from it,
run this stage's layers, and pass activations on (or sample, on the last rank).

It never touches scheduler state: what it knows arrives in plans, what it produces leaves in
a StageStepResult. Plain Python, so tests can drive it without Ray.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Optional

import numpy as np
import torch

from ray_runtime.config import EngineConfig
from ray_runtime.layer_span import LayerSpan
from ray_runtime.messages import SamplerOutput, StageStepResult, StageTiming, StepPlan
from stages.cuda_graphs import DecodeGraphs
from stages.device_state import DeviceBlockTable
from stages.input_batch import InputBatch
from stages.kv_budget import profile_kv_bytes
from stages.kv_cache import allocate_kv_cache, available_host_kv_bytes, bytes_per_block
from stages.last_rank import LastRank
from stages.model import attention_metadata, build_stage, token_layout
from stages.model_spec import ModelSpec
from stages.plan_view import PlanView, plan_view
from stages.profiling import DeviceClock, clock_on, phase, phase_clock
from stages.staging import InputStaging, to_device_async
from stages.step_types import DeviceInputs, LaunchedStep, StepInputs
from stages.token_feedback import TokenReceiver, TokenSender, num_samples
from stages.transport import StageTransport

_EMPTY = np.zeros(0, np.int64)
logger = logging.getLogger(__name__)


class StageRunner:
    def __init__(self, config: EngineConfig, rank: int, span: LayerSpan,
                 max_model_len: int, prefill_span: Optional[LayerSpan] = None) -> None:
        """span: the blocks a decode-shaped step runs here; prefill_span: a prefill-shaped
        step's (StepPlan.prefill_shaped; default span's), the same attention layers."""
        torch.set_num_threads(config.torch_threads_per_stage)
        self.config = config
        self.rank = rank
        self.is_first = rank == 0
        self.is_last = rank == config.pipeline_parallel_size - 1
        self.device = config.device
        self.dtype = getattr(torch, config.dtype)
        self.spec = ModelSpec.from_dir(config.model)
        self.model = build_stage(self.spec, span, self.is_first, self.is_last,
                                 self.dtype, self.device, max_positions=max_model_len,
                                 prefill_span=prefill_span)
        self.num_layers = len(span.attention_layers)  # the layers whose KV cache is here
        self.batch = InputBatch(config.max_num_seqs, max_model_len, config.block_size)
        # [max_num_seqs + 1] each slot's latest sample on the device: the last rank's own
        # (PP=1) or those fed back to rank 0; a first rank's pending ids read it (the last
        # entry is the decode graphs' padding rows': written by them, never read)
        self.fed_tokens = torch.zeros(config.max_num_seqs + 1, dtype=torch.long,
                                      device=self.device)
        self.last = LastRank(config, self.spec, self.model, self.batch, self.fed_tokens) \
            if self.is_last else None
        self.drafter = self.last.drafter if self.last is not None else None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs: Optional[DecodeGraphs] = None  # cuda, unless enforce_eager
        self.num_steps_run = 0  # (StageModel counts those on the prefill split's blocks)
        self.transport: Optional[StageTransport] = None
        # Token feedback (EngineConfig.feeds_tokens_back, stages/token_feedback.py): the last
        # rank sends its samples to rank 0, which embeds them; ranks in between count a
        # pending sample that the driver's next token resolves.
        self.feeds_back = config.feeds_tokens_back
        self.token_sender: Optional[TokenSender] = None  # last rank
        self.token_receiver: Optional[TokenReceiver] = None  # rank 0
        self._feedback_stream = None  # rank 0 on CUDA: the receivers' side stream
        self.batch.driver_resolves_pending = self.feeds_back and not (self.is_first or self.is_last)
        self.link_generation = 0  # how many times this rank has joined the link
        self.fault_hook = None  # tests only: called with the batch after each plan is applied
        self._gpu_spans: deque = deque()  # (step id, start, end events) not yet accounted
        self._clock_anchor: Optional[DeviceClock] = None  # the phase clock's, on CUDA
        # one staging buffer more than the steps in flight: it never holds the host back
        self.staging = InputStaging(self.device, depth=config.inflight_steps + 1)
        self.device_table = DeviceBlockTable(self.batch, self.device)

    # ---- set-up --------------------------------------------------------------------------
    def kv_block_capacity(self) -> int:
        per_block = bytes_per_block(self.spec, self.num_layers, self.config.block_size, self.dtype)
        if self.drafter is not None:
            per_block += self.drafter.bytes_per_block()
        if self.device == "cuda":
            kv_bytes = profile_kv_bytes(self)
        else:
            kv_bytes = available_host_kv_bytes(self.config.kv_cache_memory_fraction)
        if kv_bytes < per_block:
            raise RuntimeError(
                f"rank {self.rank}: no memory left for the KV cache ({kv_bytes} bytes after weights "
                f"and activations; one block needs {per_block}): raise gpu_memory_utilization "
                "or lower max_num_batched_tokens")
        return kv_bytes // per_block - (1 if self.uses_cuda_graphs else 0)  # the scratch block

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.device == "cuda" and not self.config.enforce_eager

    @torch.inference_mode()
    def init_kv_cache(self, num_blocks: int) -> None:
        # With CUDA graphs one more block: the scratch block that padding rows write to.
        extra = 1 if self.uses_cuda_graphs else 0
        self.kv_caches = allocate_kv_cache(self.spec, self.num_layers, num_blocks + extra,
                                           self.config.block_size, self.dtype, self.device)
        if self.drafter is not None:
            self.drafter.init_kv_cache(num_blocks)
        if self.uses_cuda_graphs:
            self.use_decode_graphs(scratch_block=num_blocks)

    def use_decode_graphs(self, scratch_block: int, capture: bool = True) -> None:
        """Decode steps from now on replay graphs (stages/cuda_graphs.py) on inputs staged
        into their buffer; capture=False runs the same path eagerly (CPU tests), with
        scratch_block a block no request owns."""
        self.graphs = DecodeGraphs(
            self.model, self.kv_caches, is_first=self.is_first,
            hidden_size=self.spec.hidden_size, max_rows=self.config.max_lane_size,
            mirror=self.device_table.table, fed_tokens=self.fed_tokens,
            scratch_block=scratch_block, block_size=self.config.block_size, dtype=self.dtype,
            depth=self.config.inflight_steps + 1, capture=capture,
            # the last rank's greedy steps sample in the graph (not with drafts to verify)
            greedy_head=self.last.greedy_tokens
            if self.is_last and self.config.speculative_config is None else None)

    def _forward(self, x: Optional[torch.Tensor], inputs: StepInputs,
                 head: bool = False) -> torch.Tensor:
        """A staged decode step replays a CUDA graph (with head: one ending in the greedy
        tokens); any other step runs eagerly, a prefill-shaped one on the prefill split."""
        self.num_steps_run += 1
        if inputs.staged is not None:
            return self.graphs.run(inputs.staged, x, head=head)
        return self.model(x, inputs.meta, self.kv_caches, prefill_shaped=inputs.prefill_shaped)

    def init_transport(self, store) -> None:
        """Join the inter-stage link through the rendezvous store (stages/transport.py); a
        transfer that waits longer than step_timeout_s fails."""
        if self.config.pipeline_parallel_size > 1:
            cfg = self.config
            self.transport = StageTransport.connect(
                self.rank, cfg.pipeline_parallel_size, self.device, store, cfg.step_timeout_s,
                self.spec.hidden_size, self.dtype, feedback=self.feeds_back)
            group = self.transport.feedback_group
            if group is not None and self.is_last:
                self.token_sender = TokenSender(group, self.device)
            elif group is not None and self.is_first:
                if self._feedback_stream is None and self.device == "cuda":
                    self._feedback_stream = torch.cuda.Stream()  # one for every receiver
                self.token_receiver = TokenReceiver(group, self.device, cfg.max_num_seqs,
                                                    cfg.inflight_steps, self.fed_tokens,
                                                    self._feedback_stream)
            self.link_generation += 1

    def close_transport(self) -> None:
        """Leave the link, dropping what failed steps left in flight (the driver resets it
        after a failed step: ray_runtime/link.py)."""
        if self.token_receiver is not None:
            self.token_receiver.close()
        self.token_sender = self.token_receiver = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    # ---- one step: launch, then finish ---------------------------------------------------
    # The step loop launches step N+1 before it finishes step N when N+1's plan is already
    # there: applying a plan and staging inputs overlap the device's work on the previous
    # step. A deferred sample stays on the device (it feeds the next step's input ids
    # directly) and reaches the host through one pinned copy and one event, read in finish.
    def execute(self, plan: StepPlan) -> StageStepResult:
        """One step, serially (tests, benchmarks): launch and finish at once."""
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan) -> "LaunchedStep":
        try:
            return self._launch(plan)
        except BaseException:
            self._fail_downstream(plan)
            raise

    def _fail_downstream(self, plan: StepPlan) -> None:
        """A failed step still answers the next rank (a failure header instead of the
        activations), or with token feedback rank 0 (a failure message instead of the
        samples), so it fails at once instead of waiting out a timeout; and it still takes
        its one message from the previous rank (and rank 0 from the last), so that rank's
        later sends do not wait on it."""
        step_id = plan.step_id
        if self.token_receiver is not None:  # rank 0: the last rank sends one message for it
            try:
                self.token_receiver.post_discard(step_id, num_samples(plan))
            except Exception as e:  # noqa: BLE001
                logger.warning("rank 0: could not post the receive of failed step %d: %s",
                               step_id, e)
        if self.token_sender is not None:
            try:
                self.token_sender.send_failure(step_id, num_samples(plan))
            except Exception as e:  # noqa: BLE001
                logger.warning("rank %d: could not tell rank 0 that step %d failed: %s",
                               self.rank, step_id, e)
        if self.transport is None:
            return
        if not self.is_last:
            try:
                self.transport.send_failure(step_id)
            except Exception as e:  # noqa: BLE001 - the step's own error is the one to report
                logger.warning("rank %d: could not tell rank %d that step %d failed: %s",
                               self.rank, self.rank + 1, step_id, e)
        if not self.is_first:
            try:
                self.transport.discard_from_prev(step_id)
            except Exception as e:  # noqa: BLE001
                logger.warning("rank %d: could not take step %d's message from rank %d: %s",
                               self.rank, step_id, self.rank - 1, e)

    @torch.inference_mode()
    def _launch(self, plan: StepPlan) -> "LaunchedStep":
        start = time.time()
        if self.drafter is not None:
            for req_id in plan.removed_req_ids:
                self.drafter.forget(req_id)
        with phase("apply plan"):
            self.batch.apply_plan(plan)
        if self.fault_hook is not None:
            self.fault_hook(self.batch, plan)
        if self.config.debug_checks:
            plan.check()
            self.batch.check()
        with phase("stage inputs"):
            with phase("plan view"):
                view = plan_view(plan, self.batch)  # what each request runs: inputs, digests
            inputs = self.prepare_inputs(view)
        token_wait_s, fed_from = 0.0, -1
        if self.is_first:
            x = inputs.device.token_ids  # None when staged: the graph reads its own
            if len(inputs.patch_index):  # pending samples: their ids never left the device
                t_wait = time.time()
                with phase("feed tokens"):
                    fed, fed_from = self._fed_samples(inputs.patch_slot)
                token_wait_s = time.time() - t_wait
                if inputs.staged is None:  # (a staged step patches them in its graph)
                    x = x.clone()  # the staging buffer's view stays as staged
                    x[inputs.device.patch_index] = fed[inputs.device.patch_slot]
        else:
            with phase("recv activations"):
                x = self.transport.recv_from_prev(plan.step_id, inputs.num_tokens)
        recv_done = time.time()
        # After the device's waits for this step's inputs (activations, fed-back tokens),
        # in stream order: the span from here to gpu_end is the stage's own compute.
        gpu_start = self._record_event()
        # the last rank's greedy decode step: its graph ends in the argmax (tokens, not hidden)
        in_graph = self.is_last and self.last.samples_in_graph(inputs) \
            and self.graphs.greedy_head is not None  # (a staged step has graphs)
        with phase("forward"):
            hidden = self._forward(x, inputs, head=in_graph)
        # While the device runs the step: the digests of the rows as the plan left them.
        t_digest = time.perf_counter()
        cfg = self.config
        with phase("digests"):
            digests = self.batch.digests_of(view, full=cfg.debug_checks,
                                            full_every=cfg.digest_full_every)
        digest_s = time.perf_counter() - t_digest
        with phase("mark computed"):
            self.batch.mark_computed_rows(inputs.rows, inputs.num_new)
        step = LaunchedStep(plan.step_id, start, recv_done, digests, digest_s, gpu_start,
                            token_wait_s=token_wait_s, fed_from=fed_from)
        if self.is_last:
            with phase("sample"):
                if in_graph:
                    self.last.defer(hidden, inputs, step)
                else:
                    self.last.sample_step(plan.step_id, hidden, inputs, step)
        # The stage's own device work ends here. What follows may wait on the next rank (a
        # send's buffer is free once the previous send is received): idle, not compute.
        step.gpu_end = self._record_event()
        if self.is_last:
            if self.token_sender is not None:
                with phase("send tokens"):
                    self.token_sender.send(plan.step_id, self._sampled_tokens(step))
        else:
            with phase("send activations"):
                self.transport.send_to_next(plan.step_id, hidden)
            if self.feeds_back:  # the step's samples extend the rows by pending positions
                with phase("post samples"):
                    generations = self.batch.expect_samples(inputs.sample_slots)
                    if self.token_receiver is not None:
                        self.token_receiver.post(plan.step_id, inputs.sample_slots,
                                                 generations, inputs.device.sample_slots)
        step.compute_done = time.time()
        return step

    def _fed_samples(self, patch_slots: np.ndarray) -> tuple[torch.Tensor, int]:
        """[max_num_seqs] the device buffer of each slot's latest sample, made ready for the
        pending samples of patch_slots: the last rank's own (PP=1), or those fed back; and
        the newest step whose fed-back samples the step waits for (-1: none)."""
        if self.token_receiver is not None:
            return self.fed_tokens, self.token_receiver.feed(patch_slots)
        return self.fed_tokens, -1

    def _sampled_tokens(self, step: "LaunchedStep") -> torch.Tensor:
        """The step's samples on the device, in the plan's sample order (one per request:
        feedback runs without drafts)."""
        if step.deferred is not None:
            return step.deferred.on_device
        out = step.sampler_output
        assert all(len(t) == 1 for t in out.sampled_token_ids), "token feedback with drafts"
        # not torch.tensor(list, device=...): a pageable copy, which waits for the device
        return to_device_async(np.array([t[0] for t in out.sampled_token_ids], np.int64),
                               self.device)

    def step_done(self, step: "LaunchedStep") -> bool:
        """Whether finish(step) would return without waiting for the device (or, on rank 0
        with token feedback, for the step's samples)."""
        if self.token_receiver is not None and not self.token_receiver.ready(step.step_id):
            return False
        return step.tokens_ready is None or step.tokens_ready.query()

    @property
    def clock_spans(self) -> bool:
        """Whether replies carry the device spans of steps (the phase clock, on CUDA)."""
        if self.device != "cuda" or not clock_on():
            return False
        if self._clock_anchor is None:
            self._clock_anchor = DeviceClock()
        return True

    def _record_event(self):
        if self.device != "cuda":
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def finish(self, step: "LaunchedStep") -> StageStepResult:
        """Wait for what the result needs (the deferred samples' copy), fold the samples into
        the batch, and build the result."""
        out = step.sampler_output
        d = step.deferred
        if self.token_receiver is not None:  # before the reply: the driver's copies come later
            with phase("land fed tokens"):
                self.token_receiver.land(step.step_id, self.batch)
        if d is not None:
            if step.tokens_ready is not None:
                with phase("wait for samples"):
                    step.tokens_ready.synchronize()
            tokens = d.tokens.numpy().copy()
            self.batch.land_samples(d.slots, d.generations, tokens)
            # Every sample is reported; the driver drops those of requests it removed.
            out = SamplerOutput(step_id=step.step_id, req_ids=d.req_ids, incarnations=d.incarnations,
                                sampled_token_ids=[[t] for t in tokens.tolist()])
        gpu_busy_s = 0.0
        spans = [] if self.clock_spans else None
        if step.gpu_end is not None:
            self._gpu_spans.append((step.step_id, step.gpu_start, step.gpu_end))
            while self._gpu_spans and self._gpu_spans[0][2].query():  # never waits
                sid, start, end = self._gpu_spans.popleft()
                gpu_busy_s += start.elapsed_time(end) / 1e3
                if spans is not None:
                    spans.append((sid, *self._clock_anchor.wall(start, end)))
        if self.config.debug_checks:
            self.batch.check()
        timing = StageTiming(start=step.start, recv_done=step.recv_done,
                             compute_done=step.compute_done, end=time.time(),
                             digest_s=step.digest_s, gpu_busy_s=gpu_busy_s,
                             token_wait_s=step.token_wait_s, fed_from_step=step.fed_from,
                             phases=phase_clock(),
                             gpu_spans=spans)
        return StageStepResult(step_id=step.step_id, rank=self.rank, timing=timing,
                               digests=step.digests, sampler_output=out)

    def prepare_inputs(self, view: PlanView) -> StepInputs:
        """Positions come from the plan (the driver's counts are canonical); the rank's own
        counters are audited through the digests, never trusted to place tokens."""
        b = self.batch
        rows, starts, num_new = view.slots, view.starts, view.num_new
        driver_known, drafts = view.known, view.num_drafts
        ends = starts + num_new
        # The rank's own prefix, with a pending sample (its value still on the device) counted:
        # it may exceed driver_known by the last rank's samples.
        known = b.num_tokens_known[rows] + b.num_pending_samples[rows]
        over = np.nonzero(ends > np.maximum(known, driver_known) + drafts)[0]
        if len(over):
            i = int(over[0])
            raise AssertionError(
                f"rank {self.rank}: request {view.req_ids[i]!r} scheduled up to token "
                f"{int(ends[i])} but its row knows only {int(known[i])}")
        # A slot past the row's blocks would land in block 0, another request's: refuse.
        unbacked = np.nonzero(ends > b.num_blocks[rows] * self.config.block_size)[0]
        if len(unbacked):
            i = int(unbacked[0])
            raise AssertionError(f"rank {self.rank}: request {view.req_ids[i]!r} runs up to "
                                 f"token {int(ends[i])} but holds {int(b.num_blocks[rows[i]])} KV blocks")
        layout = token_layout(rows, starts, num_new)
        query_start_loc, token_row, positions = layout
        sample = np.nonzero(ends >= driver_known)[0]
        # The sampled part of a request's tokens: those past the known prefix are drafts. The
        # last rank may know one more token than the driver (its own pending sample, PP=1).
        base = np.maximum(known, driver_known)
        num_verified = ends - base
        patch_index = patch_slot = token_ids = _EMPTY
        if self.is_first:
            token_ids = b.token_ids[token_row, positions]
            pending = positions >= b.num_tokens_known[token_row]
            if pending.any():
                # The one legitimate case: the slot's latest pending sample, whose value is
                # in the device buffer (older pending positions were run by earlier steps).
                fed = pending & (positions == b.num_tokens_known[token_row]
                                 + b.num_pending_samples[token_row] - 1)
                patch_index = np.nonzero(fed)[0]
                patch_slot = token_row[patch_index]
                token_ids[patch_index] = 0
            poisoned = token_ids < 0
            if poisoned.any():  # a row lost tokens it should know: report, don't crash
                np.add.at(b.num_conflicts, token_row[poisoned], 1)
                token_ids[poisoned] = 0
        sample_slots = rows[sample]
        sample_token_index = query_start_loc[sample + 1] - 1
        samples_every_token = len(sample) == len(positions)
        meta = staged = None
        if (self.graphs is not None and samples_every_token and len(rows) == len(positions)
                and 0 < len(rows) <= self.graphs.max_rows and not view.prefill_shaped):
            # A decode step that samples every row: staged into its graph's buffer.
            with phase("stage graph inputs"):
                staged = self.graphs.stage(rows, positions, token_ids, patch_index,
                                           sample_slots, b.block_table, self.device_table)
            device = DeviceInputs(None, None, None, None, staged.sample_slots)
        else:
            with phase("attention metadata"):
                meta, _, _, moved = attention_metadata(
                    b.block_table, rows, starts, num_new, self.config.block_size, self.device,
                    to_device=self.staging, layout=layout, device_table=self.device_table,
                    extras=[token_ids, patch_index, patch_slot, sample_token_index, sample_slots])
            device = DeviceInputs(*moved)
        req_ids = token_index = output_index = num_drafts = None  # read by the sampler alone
        if self.is_last:
            req_ids = view.req_ids if len(sample) == len(rows) else [view.req_ids[i] for i in sample]
            token_index = sample_token_index.tolist()
            output_index = (base[sample] - b.num_prompt_tokens[sample_slots]).tolist()
            num_drafts = num_verified[sample].tolist()
        return StepInputs(rows=rows, meta=meta, num_new=num_new, num_tokens=len(positions),
                          sample_req_ids=req_ids, sample_slots=sample_slots,
                          sample_token_index=token_index, sample_output_index=output_index,
                          sample_num_drafts=num_drafts, patch_index=patch_index,
                          patch_slot=patch_slot, device=device,
                          samples_every_token=samples_every_token, staged=staged,
                          prefill_shaped=view.prefill_shaped)

    def check(self) -> None:
        self.batch.check()
        self.device_table.check()

    def close(self) -> None:
        self.close_transport()
