"""The driver actor: owns the scheduler and the stage actors, and runs the step loop.

The driver's Request objects are the canonical state of every request; stages hold copies
that plans keep up to date by deltas. Each plan is encoded once with msgspec and put in the
object store once; every stage reads the same bytes.
"""
from __future__ import annotations

import logging
import time

import ray
from ray.util.placement_group import remove_placement_group

from ray_runtime.cluster import create_placement_group, start_stages
from ray_runtime.config import EngineConfig, stage_layer_ranges
from ray_runtime.messages import FinishedRequest, RequestSpec, decode_result, encode
from ray_runtime.request import Request
from ray_runtime.scheduler import Scheduler
from stages.model_spec import ModelSpec

logger = logging.getLogger(__name__)


def resolve_max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    if config.max_model_len is None:
        return spec.max_position_embeddings
    if config.max_model_len > spec.max_position_embeddings:
        raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's "
                         f"max_position_embeddings ({spec.max_position_embeddings})")
    return config.max_model_len


class Driver:
    def __init__(self, config: EngineConfig) -> None:
        logging.basicConfig(level=logging.INFO)
        self.config = config
        self.spec = ModelSpec.from_dir(config.model)
        self.max_model_len = resolve_max_model_len(config, self.spec)
        layer_ranges = stage_layer_ranges(self.spec.num_layers, config.pipeline_parallel_size,
                                          config.pp_layer_partition)
        self.pg = create_placement_group(config)
        self.stages = start_stages(config, self.pg, layer_ranges, self.max_model_len)
        self.num_kv_blocks = self._size_kv_pool()
        ray.get([s.init_kv_cache.remote(self.num_kv_blocks) for s in self.stages])
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            num_kv_blocks=self.num_kv_blocks, block_size=config.block_size,
            max_model_len=self.max_model_len)
        self.eos_token_ids = frozenset(self.spec.eos_token_ids)
        self._arrivals = 0
        self._stage_compute_s = [0.0] * config.pipeline_parallel_size
        self._step_wall_s = 0.0
        self._num_requests_finished = 0
        self._num_prompt_tokens = 0

    def _size_kv_pool(self) -> int:
        bs = self.config.block_size
        useful = self.config.max_num_seqs * -(-self.max_model_len // bs)
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        capacity = min(ray.get([s.kv_block_capacity.remote() for s in self.stages]))
        return max(1, min(capacity, useful))

    def info(self) -> dict:
        return {"vocab_size": self.spec.vocab_size, "max_model_len": self.max_model_len,
                "num_kv_blocks": self.num_kv_blocks, "block_size": self.config.block_size,
                "eos_token_ids": list(self.spec.eos_token_ids),
                "num_layers": self.spec.num_layers}

    # ---- serving -------------------------------------------------------------------------
    def generate(self, requests: list[RequestSpec]) -> list[FinishedRequest]:
        sched = self.scheduler
        for spec in requests:
            sched.add_request(Request(spec.req_id, spec.prompt_token_ids, spec.sampling,
                                      self.eos_token_ids, self._arrivals))
            self._arrivals += 1
            self._num_prompt_tokens += len(spec.prompt_token_ids)
        finished: list[FinishedRequest] = []
        while sched.has_unfinished():
            self._step()
            finished.extend(self._collect(sched.pop_finished()))
        return finished

    def _step(self) -> None:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan is None:
            raise RuntimeError("scheduler has unfinished requests but planned nothing")
        plan_ref = ray.put(encode(plan))
        results = [decode_result(r) for r in ray.get([s.execute.remote(plan_ref) for s in self.stages])]
        for res in results:
            self._stage_compute_s[res.rank] += res.compute_s
        self.scheduler.update_from_output(plan, results[-1].sampler_output)
        if self.config.debug_checks:
            self.scheduler.check()
        self._step_wall_s += time.perf_counter() - t0

    def _collect(self, done: list[Request]) -> list[FinishedRequest]:
        out = []
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
        s = self.scheduler
        return {"num_steps": s.num_steps, "num_preemptions": s.num_preemptions,
                "num_generated_tokens": s.num_generated_tokens,
                "num_prompt_tokens": self._num_prompt_tokens,
                "num_scheduled_tokens": s.num_scheduled_tokens_total,
                "num_requests_finished": self._num_requests_finished,
                "num_kv_blocks": self.num_kv_blocks, "num_free_kv_blocks": s.blocks.num_free_blocks,
                "step_wall_s": self._step_wall_s, "stage_compute_s": list(self._stage_compute_s)}

    def check(self) -> None:
        self.scheduler.check()
        ray.get([s.check.remote() for s in self.stages])

    def set_fault_hook(self, rank: int, hook) -> None:
        ray.get(self.stages[rank].set_fault_hook.remote(hook))

    def shutdown(self) -> None:
        try:
            ray.get([s.close.remote() for s in self.stages], timeout=30)
        finally:
            for s in self.stages:
                ray.kill(s)
            remove_placement_group(self.pg)
