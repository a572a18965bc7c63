"""One /v1/completions or /v1/chat/completions request run on an AsyncLLM.

Every prompt is tokenized and checked against the engine's limits here, before anything is
sent to the engine (ray_runtime/validation.py's validate_request, the check generate() runs
again): a bad request is a RequestError (400) before a streamed response has started, and no
prompt of a batch starts when another is bad. A completion with several prompts runs them
concurrently and streams their chunks as they come.

A client that goes away cancels the coroutine consuming the engine's stream (Ray Serve
cancels a request whose HTTP client disconnected); every engine stream is closed in a
`finally` (contextlib.aclosing), and AsyncLLM.generate aborts a request whose consumer stops
before it finished, freeing its KV blocks and rank slots.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import AsyncIterator, Union

from ray_runtime.outputs import RequestOutput
from ray_runtime.sampling_params import SamplingParams
from ray_runtime.server.protocol import (ChatCompletionRequest, CompletionRequest, RequestError,
                                         error_body, from_engine_error)
from ray_runtime.server.responses import SSE_DONE, Responder, sse
from ray_runtime.validation import validate_request

logger = logging.getLogger(__name__)


def check_model(engine_model_name: str, requested) -> None:
    if requested is not None and requested != engine_model_name:
        raise RequestError(f"model: the model {requested!r} does not exist; this server "
                           f"serves {engine_model_name!r}", "model")


def prepare(engine, index: int, prompt: Union[str, list[int], dict], sp: SamplingParams,
            param: str) -> dict:
    """One prompt tokenized and checked: {"prompt", "prompt_token_ids"} for generate()."""
    if isinstance(prompt, dict):
        text, ids = prompt["prompt"], prompt["prompt_token_ids"]
    elif isinstance(prompt, str):
        if engine.tokenizer is None:
            raise RequestError(f"{param}: {engine.config.model!r} has no tokenizer; send the "
                               "prompt as a list of token ids", param)
        text, ids = prompt, engine.tokenizer(prompt).input_ids
    else:
        text, ids = None, prompt
    info = engine.info
    try:
        ids = validate_request(index, ids, sp, vocab_size=info["vocab_size"],
                               max_model_len=info["max_model_len"],
                               num_kv_blocks=info["num_kv_blocks"], block_size=info["block_size"],
                               num_lookahead=engine.config.num_speculative_tokens)
    except (TypeError, ValueError) as e:
        raise from_engine_error(e, {}, param) from None
    return {"prompt": text, "prompt_token_ids": ids} if text is not None \
        else {"prompt_token_ids": ids}


async def _final(engine, prompt: dict, sp: SamplingParams, request_id: str) -> RequestOutput:
    last = None
    async with contextlib.aclosing(engine.generate(prompt, sp, request_id)) as gen:
        async for out in gen:
            last = out
    return last


async def _merged(engine, prompts: list[dict], sp: SamplingParams, request_id: str
                  ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) of every prompt's stream, as they arrive."""
    if len(prompts) == 1:
        async with contextlib.aclosing(engine.generate(prompts[0], sp, request_id)) as gen:
            async for out in gen:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int) -> None:
        try:
            async with contextlib.aclosing(engine.generate(prompts[i], sp,
                                                           f"{request_id}-{i}")) as gen:
                async for out in gen:
                    queue.put_nowait((i, out))
            queue.put_nowait((i, end))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, raised there
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(prompts))]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _stream(engine, responder: Responder, prompts: list[dict], sp: SamplingParams,
                  include_usage: bool) -> AsyncIterator[str]:
    try:
        async with contextlib.aclosing(_merged(engine, prompts, sp, responder.id)) as outs:
            async for i, out in outs:
                chunk = responder.chunk(i, out)
                if chunk is not None:
                    yield sse(chunk)
        if include_usage:
            yield sse(responder.usage_chunk())
    except Exception as e:  # noqa: BLE001 - the engine failed the request (RequestFailed)
        # or is gone: the status line has been sent, so the stream says it, then ends
        logger.error("stream %s failed: %s: %s", responder.id, type(e).__name__, e)
        yield sse(error_body(f"{type(e).__name__}: {e}", None, 500, "InternalServerError"))
    yield SSE_DONE


async def run(engine, prompts: list[dict], sp: SamplingParams,
              responder: Responder, stream: bool, include_usage: bool
              ) -> Union[dict, AsyncIterator[str]]:
    """The response body (non-streamed), or the SSE text chunks of the stream."""
    if stream:
        return _stream(engine, responder, prompts, sp, include_usage)
    ids = [responder.id] if len(prompts) == 1 else \
        [f"{responder.id}-{i}" for i in range(len(prompts))]
    outs = await asyncio.gather(*(_final(engine, p, sp, r) for p, r in zip(prompts, ids)))
    return responder.final(list(outs))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def completion(engine, model_name: str, req: CompletionRequest):
    check_model(model_name, req.model)
    raw = req.prompts()
    sp = req.to_sampling_params()
    param = "prompt"
    prompts = [prepare(engine, i, p, sp, param) for i, p in enumerate(raw)]
    responder = Responder(new_id("cmpl"), model_name, chat=False, n=sp.n, top_k=req.logprobs,
                          return_token_ids=req.return_token_ids)
    return await run(engine, prompts, sp, responder, req.stream, req.include_usage)


async def chat(engine, model_name: str, req: ChatCompletionRequest):
    check_model(model_name, req.model)
    conversation = req.conversation()
    try:
        rendered = engine.render_chat(conversation)
    except Exception as e:  # noqa: BLE001 - no template, or the template rejected the messages
        msg = str(e)
        raise RequestError(msg if msg.startswith("messages") else f"messages: {msg}",
                           "messages") from None
    room = max(1, engine.info["max_model_len"] - len(rendered["prompt_token_ids"]))
    sp = req.to_sampling_params(default_max_tokens=room)
    prompts = [prepare(engine, 0, rendered, sp, "messages")]
    responder = Responder(new_id("chatcmpl"), model_name, chat=True, n=sp.n,
                          top_k=(req.top_logprobs or 0) if req.logprobs else None,
                          return_token_ids=req.return_token_ids)
    return await run(engine, prompts, sp, responder, req.stream, req.include_usage)
