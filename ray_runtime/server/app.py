"""The OpenAI-compatible server as a Ray Serve application.

    serve run cluster_configs/serve_config.yaml          # import path ray_runtime.server.app:build_app
    python -m ray_runtime serve --model DIR -pp 2        # the same app from the CLI

Routes: POST /v1/completions, POST /v1/chat/completions (stream true/false; streams are
server-sent events ending with `data: [DONE]`), GET /v1/models, GET /health (200 while the
engine steps, else 503), GET /metrics (ray_runtime/server/metrics.py). Bad input is a 400 with
OpenAI's error body naming the field (ray_runtime/server/protocol.py); the server keeps
serving. The replica holds one AsyncLLM: its driver and stage actors are Ray actors of their
own, so the replica asks for no CPU (num_cpus=0) and places beside the stages on a small
machine. Serve's own health check calls the engine's: a dead engine gets its replica
replaced (and with it a new engine).
"""

import asyncio
import inspect
import json
import logging
import time
from dataclasses import fields
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve

from ray_runtime.output_processor import RequestFailed
from ray_runtime.server import serving
from ray_runtime.server.metrics import scrape
from ray_runtime.server.protocol import (ChatCompletionRequest, CompletionRequest, RequestError,
                                         error_body, from_engine_error, parse)

logger = logging.getLogger(__name__)
app = FastAPI(title="ray_runtime: OpenAI-compatible server")

# build_app's arguments beyond the engine's keywords.
APP_ARGS = {"served_model_name": None, "max_ongoing_requests": 256, "num_replicas": 1}


def engine_keywords() -> set[str]:
    """Every keyword AsyncLLM takes: EngineClient's signature plus EngineConfig's fields."""
    from ray_runtime.config import EngineConfig
    from ray_runtime.engine_client import EngineClient

    sig = inspect.signature(EngineClient.__init__).parameters
    return ({n for n, p in sig.items() if p.kind == p.POSITIONAL_OR_KEYWORD} - {"self"}) | \
        {f.name for f in fields(EngineConfig)}


def _error(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


@serve.deployment(name="OpenAIServer", ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=APP_ARGS["max_ongoing_requests"],
                  health_check_period_s=10, health_check_timeout_s=30)
@serve.ingress(app)
class OpenAIServer:
    def __init__(self, engine_kwargs: dict, served_model_name: Optional[str] = None) -> None:
        from ray_runtime.async_llm import AsyncLLM

        self.engine = AsyncLLM(**engine_kwargs)
        self.model_name = served_model_name or engine_kwargs["model"]
        self.created = int(time.time())

    async def _serve(self, request: Request, model: type, handler) -> Response:
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError(f"the request body is not JSON: {e}") from None
            req = parse(model, body)
            result = await handler(self.engine, self.model_name, req)
        except RequestError as e:
            return _error(e)
        except ValueError as e:  # the engine's own checks (InputTypeError is one too)
            return _error(from_engine_error(e, {}, "prompt"))
        except (RequestFailed, RuntimeError) as e:  # the engine failed the request, or is dead
            logger.error("%s failed: %s: %s", request.url.path, type(e).__name__, e)
            return JSONResponse(error_body(f"{type(e).__name__}: {e}", None, 500,
                                           "InternalServerError"), 500)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest, serving.completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, ChatCompletionRequest, serving.chat)

    @app.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "ray_runtime", "root": self.engine.config.model,
            "max_model_len": self.engine.info["max_model_len"]}]}

    @app.get("/health")
    async def health(self) -> Response:
        if await self.engine.check_health():
            return Response(status_code=200)
        return JSONResponse(error_body("the engine is not stepping", None, 503,
                                       "ServiceUnavailableError"), status_code=503)

    @app.get("/metrics")
    async def metrics(self) -> Response:
        text, failed = await asyncio.to_thread(scrape)
        if not text and failed:
            return JSONResponse(error_body(
                f"no Ray metrics export answered ({', '.join(failed)}): serving it needs "
                "Ray's dashboard extras, ray[default]", None, 503, "ServiceUnavailableError"),
                status_code=503)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- Ray Serve and tests (deployment-handle calls, not HTTP routes) ------------------
    async def check_health(self) -> None:
        """Serve's replica health check: a dead engine fails it (Serve replaces the replica)."""
        if not await self.engine.check_health():
            raise RuntimeError(f"the engine is unhealthy: {await self.engine.health()}")

    async def engine_stats(self) -> dict:
        return await asyncio.to_thread(self.engine.stats)

    async def engine_check(self) -> None:
        """Every invariant of the engine (scheduler, block pool, each rank's InputBatch)."""
        await asyncio.to_thread(self.engine.check)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def build_app(args: dict[str, Any]):
    """The Serve application: `args` holds the AsyncLLM keywords (model, pipeline_parallel_size,
    ...) plus served_model_name, max_ongoing_requests and num_replicas. Unknown keys are a
    ValueError naming them, before anything is deployed."""
    if not isinstance(args, dict):
        raise ValueError(f"build_app takes a dict of arguments, got {type(args).__name__}")
    args = dict(args)
    if not args.get("model"):
        raise ValueError("build_app: 'model' (the model folder) is required")
    app_args = {k: args.pop(k, v) for k, v in APP_ARGS.items()}
    unknown = sorted(set(args) - engine_keywords())
    if unknown:
        raise ValueError(f"build_app: unknown arguments {unknown}; known: the AsyncLLM "
                         f"keywords and {sorted(APP_ARGS)}")
    return OpenAIServer.options(
        num_replicas=app_args["num_replicas"],
        max_ongoing_requests=app_args["max_ongoing_requests"],
    ).bind(args, app_args["served_model_name"])
