"""The online API, vLLM's AsyncLLM shape: requests join the running engine at any time, from
many coroutines at once, and their outputs stream back as tokens are committed.

    engine = AsyncLLM(model, pipeline_parallel_size=2)
    async for out in engine.generate(prompt, SamplingParams(...), request_id="a"):
        print(out.outputs[0].text)
    await engine.abort("a")

One task per AsyncLLM long-polls the driver's outputs and hands each request's RequestOutputs
to the queue of the coroutine iterating it. A consumer that stops iterating (a client that
disconnects) aborts its request. Not thread-safe: use an AsyncLLM from one event loop.

Hosted in an async Ray actor (a Ray Serve replica), a request runs inside one actor task, and
Ray cancels an actor task recursively: every Ray call submitted in its context (a contextvar)
goes with it. The shared output poll and each request's add and abort are therefore submitted
from a fresh context (`_detached`), so a client hanging up cancels its own request only.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from typing import AsyncIterator, Optional

from ray_runtime.engine_client import EngineClient, PromptType
from ray_runtime.output_processor import OutputProcessor, result
from ray_runtime.outputs import RequestOutput
from ray_runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
POLL_S = 0.5  # how long one poll of the engine's outputs may wait


def _detached(fn, *args):
    """fn(*args) outside the calling task's context: a Ray call made here is no child of the
    actor task running now, and is not cancelled when that task is."""
    return contextvars.Context().run(fn, *args)


class AsyncLLM(EngineClient):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._processor = OutputProcessor(self.tokenizer)
        self._queues: dict[str, asyncio.Queue] = {}
        self._handler: Optional[asyncio.Task] = None
        self._dead: Optional[str] = None

    async def generate(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """RequestOutputs of one request as its tokens arrive (sampling_params.output_kind:
        CUMULATIVE, DELTA or FINAL_ONLY), the last one with finished=True. Bad input raises
        here, before anything is sent; a request the engine fails raises RequestFailed."""
        if self._closed:
            raise RuntimeError("AsyncLLM has been shut down")
        if self._dead is not None:
            raise RuntimeError(f"the engine is dead ({self._dead})")
        sp = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sp).__name__}")
        sp.validate()
        request_id = str(uuid.uuid4().hex) if request_id is None else request_id
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already running")
        text, token_ids, sp = self._prepare(0, prompt, sp)
        queue: asyncio.Queue = asyncio.Queue()
        specs = self._register(self._processor, request_id, text, token_ids, sp)
        self._queues[request_id] = queue
        finished = False
        add_ref = None
        try:
            self._ensure_handler()
            add_ref = _detached(self._driver.add_requests.remote, specs)
            await add_ref
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield result(out)
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # the consumer went away (or the call failed): stop the request
                ids = self._processor.engine_ids(request_id)
                self._processor.forget(request_id)
                if ids and self._dead is None and add_ref is not None:
                    # Sent at once, without the event loop (which may be closing): an abort
                    # that overtakes its add is applied when the add lands (engine_loop.py).
                    _detached(self._driver.abort.remote, ids)

    async def abort(self, request_id: str) -> None:
        """Stop a request: its stream ends with finish_reason "abort", its KV blocks and rank
        slots are freed. Unknown or finished ids are ignored."""
        ids = self._processor.engine_ids(request_id)
        if ids:
            await self._driver.abort.remote(ids)

    async def check_health(self) -> bool:
        """True while the engine is stepping (alive, and idle or within its step deadline)."""
        if self._closed or self._dead is not None:
            return False
        try:
            return bool((await self._driver.health.remote())["healthy"])
        except Exception:  # noqa: BLE001 - a dead driver is an unhealthy engine
            return False

    async def health(self) -> dict:
        return await self._driver.health.remote()

    def _ensure_handler(self) -> None:
        if self._handler is None or self._handler.done():
            self._handler = asyncio.get_running_loop().create_task(
                self._output_handler(), context=contextvars.Context())

    async def _output_handler(self) -> None:
        """Poll the engine's outputs and hand them to the waiting generators."""
        driver, processor = self._driver, self._processor
        try:
            while not self._closed:
                # A poll cut short (this task cancelled) loses nothing: the next one
                # acknowledges the same batch and gets its outputs again.
                seq, deltas = await driver.get_outputs.remote(self._ack, POLL_S)
                outs, aborts = processor.process(deltas)
                self._ack = seq
                if aborts:
                    driver.abort.remote(aborts)
                for out in outs:
                    q = self._queues.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the engine is gone: every stream fails
            self._dead = f"{type(e).__name__}: {e}"
            logger.error("the engine's outputs stopped: %s", self._dead)
            for out in processor.fail_all(self._dead):
                q = self._queues.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the engine; every stream still running ends with RequestFailed."""
        for out in self._processor.fail_all("the engine was shut down"):
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)
        if self._handler is not None:
            self._handler.cancel()
        super().shutdown(graceful)
