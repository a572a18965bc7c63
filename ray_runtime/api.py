"""The offline API: LLM.generate() and LLM.chat(), with vLLM's names and shapes.

A call adds its requests to the running engine and polls their outputs as they finish (the
same path as AsyncLLM, ray_runtime/async_llm.py, with every output FINAL_ONLY).
"""
from __future__ import annotations

import threading
import time
import uuid
from typing import Sequence, Union

import msgspec
import ray

from ray_runtime.checks import InputTypeError
from ray_runtime.engine_client import EngineClient, PromptType
from ray_runtime.output_processor import OutputProcessor, RequestFailed
from ray_runtime.outputs import RequestOutput
from ray_runtime.progress import Progress
from ray_runtime.sampling_params import RequestOutputKind, SamplingParams
from ray_runtime.validation import as_params_list, as_prompt_list

POLL_S = 1.0  # how long one poll of the engine's outputs may wait


def first_chunk(specs: list, tokens: int) -> int:
    """How many of a call's requests to add before the rest: the fewest whose prompts hold
    `tokens` (two steps' budget for each lane), at least one. Adding 1,024 prompts of 256
    tokens at once took ~50 ms on a 2-core machine, all of it idle pipeline."""
    total = 0
    for i, spec in enumerate(specs):
        total += len(spec.prompt_token_ids)
        if total >= tokens:
            return i + 1
    return len(specs)


class LLM(EngineClient):
    """`LLM(model, pipeline_parallel_size=...)`, then `generate` or `chat`. One call runs at a
    time per LLM (calls from several threads queue)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._call_lock = threading.Lock()

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in prompt order. use_tqdm: a progress bar on a terminal, a log line every
        few seconds otherwise (job logs), for calls that last long enough to need one."""
        if self._closed:
            raise RuntimeError("LLM has been shut down")
        prompts = as_prompt_list(prompts)
        params = as_params_list(sampling_params, len(prompts))
        # One SamplingParams for many prompts (the usual call) is checked and copied once.
        checked: set[int] = set()
        prepared = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            prepared.append(self._prepare(i, p, sp, params_checked=id(sp) in checked))
            checked.add(id(sp))
        if not prepared:
            return []
        processor = OutputProcessor(self.tokenizer)
        order, specs = [], []
        finals: dict[int, SamplingParams] = {}
        for i, (text, token_ids, sp) in enumerate(prepared):
            rid = f"{i}-{uuid.uuid4().hex[:12]}"
            final = finals.get(id(sp))
            if final is None:
                final = finals[id(sp)] = msgspec.structs.replace(
                    sp, output_kind=RequestOutputKind.FINAL_ONLY)
            specs += self._register(processor, rid, text, token_ids, final)
            order.append(rid)
        with self._call_lock:
            return self._run(processor, order, specs, Progress(len(order), enabled=use_tqdm))

    def _run(self, processor: OutputProcessor, order: list[str], specs, progress: Progress
             ) -> list[RequestOutput]:
        """Add the requests, then poll until each has finished or failed. If any failed,
        RequestFailed (its `finished`: the ones that did not)."""
        driver = self._driver
        done: dict[str, RequestOutput] = {}
        failed: dict[str, str] = {}
        try:
            # The first steps' requests first, the rest once those are in: the driver plans
            # while the rest are serialized and added, and adds them in order.
            first = first_chunk(specs, 2 * self.config.pipeline_parallel_size
                                * self.config.max_num_batched_tokens)
            ray.get(driver.add_requests.remote(specs[:first]))
            if first < len(specs):
                ray.get(driver.add_requests.remote(specs[first:]))
            while len(done) + len(failed) < len(order):
                outs, aborts = processor.process(self._poll(POLL_S))
                if aborts:
                    driver.abort.remote(aborts)
                for out in outs:
                    if out.error is not None:
                        failed[out.request_id] = out.error
                    else:
                        done[out.request_id] = out
                        progress.update(sum(len(c.token_ids) for c in out.outputs))
                progress.tick()
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"the engine's driver actor died ({e.__class__.__name__}); "
                               "shut this LLM down and create a new one") from e
        except BaseException:
            # This call's requests still running stop now; the engine goes on serving.
            left = [e for rid in order for e in processor.engine_ids(rid)]
            if left:
                try:
                    ray.get(driver.abort.remote(left), timeout=10)
                except Exception:  # noqa: BLE001 - a dead driver has nothing left to abort
                    pass
                self._drain(processor, left)
            raise
        finally:
            progress.close()
        if failed:
            first = next(failed[rid] for rid in order if rid in failed)
            raise RequestFailed(f"{len(failed)} of {len(order)} requests failed: {first}",
                                finished=[done[rid] for rid in order if rid in done])
        return [done[rid] for rid in order]

    def _drain(self, processor: OutputProcessor, left: list[str], timeout_s: float = 30.0) -> None:
        """After an aborted call: read the aborted requests' last outputs, so that the next
        call does not see them."""
        waiting = set(left)
        deadline = time.monotonic() + timeout_s
        while waiting and time.monotonic() < deadline:
            try:
                deltas = self._poll(0.5)
            except Exception:  # noqa: BLE001 - the engine is gone: nothing to drain
                return
            waiting.difference_update(d.req_id for d in deltas if d.finished)

    def chat(self, conversations: Union[list[dict], Sequence[list[dict]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Like vLLM's LLM.chat: one conversation (a list of messages) or several."""
        if not isinstance(conversations, (list, tuple)):
            raise InputTypeError(f"conversations must be a list of messages or a list of such "
                                 f"lists, got {type(conversations).__name__}")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([self.render_chat(c) for c in conversations], sampling_params,
                             use_tqdm=use_tqdm)
