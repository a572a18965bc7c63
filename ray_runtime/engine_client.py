"""What LLM (offline, blocking) and AsyncLLM (online, streaming) share: the engine's
configuration, its driver actor, the tokenizer, request checks in the caller, and the engine's
stats, checks and shutdown."""
from __future__ import annotations

import logging
import os
import uuid
from typing import Optional, Sequence, Union

import ray

from ray_runtime.cluster import connect_ray, driver_actor_name
from ray_runtime.config import EngineConfig
from ray_runtime.layer_span import stage_blocks
from ray_runtime.driver import DRIVER_MAX_CONCURRENCY, Driver, resolve_max_model_len
from ray_runtime.messages import RequestSpec
from ray_runtime.output_processor import OutputProcessor, child_ids, child_params
from ray_runtime.sampling_params import SamplingParams
from ray_runtime.validation import parse_prompt, validate_request
from stages.model_spec import ModelSpec

PromptType = Union[str, dict, Sequence[int]]  # text, {prompt, prompt_token_ids}, token ids


def load_tokenizer(model_dir: str):
    if not any(os.path.isfile(os.path.join(model_dir, f))
               for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class EngineClient:
    """What LLM and AsyncLLM share: the engine's configuration, its driver actor, the
    tokenizer, request checks in the caller, and the engine's stats and shutdown."""

    def __init__(self, model: str, tokenizer: Optional[str] = None, **engine_args) -> None:
        """engine_args: any EngineConfig field (ray_runtime/config.py holds every option and
        its default; the CLI's flags are made from the same fields)."""
        self.config = EngineConfig.from_kwargs(model, **engine_args)
        # Every check that can fail on the config fails here, before any actor starts.
        spec = ModelSpec.from_dir(model)
        stage_blocks(spec.num_layers, self.config.pipeline_parallel_size,
                     self.config.pp_layer_partition, self.config.pp_prefill_partition,
                     spec.attention_share)
        resolve_max_model_len(self.config, spec)
        sc = self.config.speculative_config
        if sc is not None and sc.method == "draft_model":
            draft_vocab = ModelSpec.from_dir(sc.model).vocab_size
            if draft_vocab != spec.vocab_size:
                raise ValueError(f"speculative_config.model: the draft's vocab_size {draft_vocab} "
                                 f"differs from the target's {spec.vocab_size}")
        self.tokenizer = load_tokenizer(tokenizer or model)
        connect_ray(self.config)
        engine_id = uuid.uuid4().hex[:8]
        self._driver = ray.remote(num_cpus=0, max_concurrency=DRIVER_MAX_CONCURRENCY)(
            Driver).options(name=driver_actor_name(engine_id)).remote(self.config, engine_id)
        self.info = ray.get(self._driver.info.remote())
        self._closed = False
        # The last output batch taken from the driver (EngineLoop.get_outputs): one consumer
        # per engine, which acknowledges what it has processed.
        self._ack = 0
        self.final_stats: Optional[dict] = None  # stats() as they were at shutdown


    def render_chat(self, messages: list[dict]) -> dict:
        """One conversation through the model's chat template, as a prompt for generate().
        The template already holds the special tokens, so none are added on tokenizing."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"messages: {self.config.model!r} has no tokenizer chat template")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        return {"prompt": text, "prompt_token_ids": ids}


    def _tokenize(self, index: int, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"prompts[{index}]: a text prompt needs a tokenizer, and "
                             f"{self.config.model!r} has none; pass prompt_token_ids")
        return self.tokenizer(text).input_ids


    def _prepare(self, index: int, prompt, sp: SamplingParams, params_checked: bool = False
                 ) -> tuple[Optional[str], list[int], SamplingParams]:
        """One request checked and converted in the caller: (text, token ids, params).
        params_checked: sp was checked for an earlier request of the same call."""
        text, token_ids = parse_prompt(index, prompt)
        if sp.stop and (self.tokenizer is None or not sp.detokenize):
            raise ValueError(f"prompts[{index}]: SamplingParams.stop matches text, which needs "
                             f"a tokenizer and detokenize=True; {self.config.model!r} has "
                             f"{'none' if self.tokenizer is None else 'detokenize=False'}: "
                             "use stop_token_ids")
        if token_ids is None:
            token_ids = self._tokenize(index, text)
        token_ids = validate_request(index, token_ids, sp, vocab_size=self.info["vocab_size"],
                                     max_model_len=self.info["max_model_len"],
                                     num_kv_blocks=self.info["num_kv_blocks"],
                                     block_size=self.info["block_size"],
                                     num_lookahead=self.config.num_speculative_tokens,
                                     check_params=not params_checked)
        return text, token_ids, sp

    def _register(self, processor: OutputProcessor, request_id: str, text: Optional[str],
                  token_ids: list[int], sp: SamplingParams) -> list[RequestSpec]:
        """The engine requests of one prompt (n of them for n > 1), known to `processor`."""
        n = sp.n
        ids = child_ids(request_id, n)
        clash = processor.in_use(ids)
        if clash is not None:
            raise ValueError(f"request_id {request_id!r}: its engine request {clash!r} is "
                             "already running (n > 1 runs as '{i}_{request_id}')")
        params = [child_params(sp, i, n) for i in range(n)]
        processor.add(request_id, text, token_ids, sp, ids, params)
        return [RequestSpec(req_id=e, prompt_token_ids=token_ids, sampling=p)
                for e, p in zip(ids, params)]

    def _poll(self, timeout_s: float) -> list:
        """The driver's outputs since the last processed batch (blocking)."""
        seq, deltas = ray.get(self._driver.get_outputs.remote(self._ack, timeout_s))
        self._ack = seq
        return deltas

    # ---- engine --------------------------------------------------------------------------
    def stats(self) -> dict:
        return ray.get(self._driver.stats.remote())

    def metrics_snapshot(self) -> Optional[dict]:
        """Tests only: what the engine's metrics have recorded so far (ray_runtime/metrics.py,
        `EngineMetrics.snapshot`), None with disable_log_stats. To watch the metrics, use
        the Ray dashboard or Prometheus (docs/operations.md)."""
        return ray.get(self._driver.metrics_snapshot.remote())

    def _set_fault_hook(self, rank: int, hook) -> None:
        """Tests only: `hook(batch, plan)` runs on stage `rank` after each plan is applied,
        to corrupt its bookkeeping and prove that the audit catches it."""
        ray.get(self._driver.set_fault_hook.remote(rank, hook))

    def check(self) -> None:
        """Run every invariant check: scheduler, block pool, and each rank's InputBatch."""
        ray.get(self._driver.check.remote())

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the engine; never raises. graceful=False (an interrupt): kill the driver at
        once without waiting for a running call; its stages and placement group die with it."""
        if self._closed:
            return
        self._closed = True
        try:
            if graceful:
                self.final_stats = ray.get(self._driver.stats.remote(), timeout=60)
                ray.get(self._driver.shutdown.remote(), timeout=60)
        except Exception as e:  # noqa: BLE001 - shutdown never raises: the kill below stops it
            logging.getLogger(__name__).warning(
                "shutdown: the engine did not stop cleanly (%s: %s); killed it",
                type(e).__name__, e)
        finally:
            try:
                ray.kill(self._driver)
            except Exception:  # noqa: BLE001 - already gone: nothing left to stop
                pass

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # An interrupt must not wait behind the call it interrupted.
        self.shutdown(graceful=exc_type is None or issubclass(exc_type, Exception))
