"""The Python API: LLM and generate(), with vLLM's names and shapes."""
from __future__ import annotations

import logging
import os
import uuid
from typing import Optional, Sequence, Union

import ray

from ray_runtime.cluster import connect_ray, driver_actor_name
from ray_runtime.config import EngineConfig, parse_partition, stage_layer_ranges
from ray_runtime.driver import Driver, resolve_max_model_len
from ray_runtime.messages import FinishedRequest, RequestSpec
from ray_runtime.outputs import CompletionOutput, Logprob, RequestOutput
from ray_runtime.sampling_params import SamplingParams
from ray_runtime.checks import InputTypeError
from ray_runtime.validation import as_params_list, as_prompt_list, parse_prompt, validate_request
from stages.model_spec import ModelSpec

PromptType = Union[str, dict, Sequence[int]]  # text, {prompt, prompt_token_ids}, token ids


def load_tokenizer(model_dir: str):
    if not any(os.path.isfile(os.path.join(model_dir, f))
               for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class LLM:
    def __init__(self, model: str, pipeline_parallel_size: int = 1, device: str = "cpu",
                 dtype: str = "float32", max_num_seqs: int = 64, max_num_batched_tokens: int = 256,
                 block_size: int = 16, num_kv_blocks: Optional[int] = None,
                 pp_layer_partition: Union[str, Sequence[int], None] = None,
                 async_scheduling: bool = True, max_model_len: Optional[int] = None,
                 tokenizer: Optional[str] = None, trace_file: Optional[str] = None,
                 on_mismatch: str = "repair", **engine_kwargs) -> None:
        if trace_file is not None:
            trace_file = os.path.abspath(trace_file)
        self.config = EngineConfig(
            model=model, pipeline_parallel_size=pipeline_parallel_size, device=device,
            dtype=dtype, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size, num_kv_blocks=num_kv_blocks,
            pp_layer_partition=parse_partition(pp_layer_partition),
            async_scheduling=async_scheduling, max_model_len=max_model_len,
            trace_file=trace_file, on_mismatch=on_mismatch, **engine_kwargs)
        # Every check that can fail on the config fails here, before any actor starts.
        spec = ModelSpec.from_dir(model)
        stage_layer_ranges(spec.num_layers, pipeline_parallel_size, self.config.pp_layer_partition)
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
        self._driver = ray.remote(num_cpus=0)(Driver).options(
            name=driver_actor_name(engine_id)).remote(self.config, engine_id)
        self.info = ray.get(self._driver.info.remote())
        self._closed = False
        self.final_stats: Optional[dict] = None  # stats() as they were at shutdown

    # ---- generation ----------------------------------------------------------------------
    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None
                 ) -> list[RequestOutput]:
        if self._closed:
            raise RuntimeError("LLM has been shut down")
        prompts = as_prompt_list(prompts)
        params = as_params_list(sampling_params, len(prompts))
        specs, texts = [], []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            text, token_ids = parse_prompt(i, prompt)
            if token_ids is None:
                token_ids = self._tokenize(i, text)
            token_ids = validate_request(i, token_ids, sp, vocab_size=self.info["vocab_size"],
                                         max_model_len=self.info["max_model_len"],
                                         num_kv_blocks=self.info["num_kv_blocks"],
                                         block_size=self.info["block_size"],
                                         num_lookahead=self.config.num_speculative_tokens)
            specs.append(RequestSpec(req_id=f"{i}-{uuid.uuid4().hex[:12]}",
                                     prompt_token_ids=token_ids, sampling=sp))
            texts.append(text)
        if not specs:
            return []
        finished = {f.req_id: f for f in ray.get(self._driver.generate.remote(specs))}
        return [self._to_output(finished[s.req_id], text, s.sampling)
                for s, text in zip(specs, texts)]

    def render_chat(self, messages: list[dict]) -> dict:
        """One conversation through the model's chat template, as a prompt for generate().
        The template already holds the special tokens, so none are added on tokenizing."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"messages: {self.config.model!r} has no tokenizer chat template")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        return {"prompt": text, "prompt_token_ids": ids}

    def chat(self, conversations: Union[list[dict], Sequence[list[dict]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None
             ) -> list[RequestOutput]:
        """Like vLLM's LLM.chat: one conversation (a list of messages) or several."""
        if not isinstance(conversations, (list, tuple)):
            raise InputTypeError(f"conversations must be a list of messages or a list of such "
                                 f"lists, got {type(conversations).__name__}")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([self.render_chat(c) for c in conversations], sampling_params)

    def _tokenize(self, index: int, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"prompts[{index}]: a text prompt needs a tokenizer, and "
                             f"{self.config.model!r} has none; pass prompt_token_ids")
        return self.tokenizer(text).input_ids

    def _to_output(self, f: FinishedRequest, prompt: Optional[str],
                   sp: SamplingParams) -> RequestOutput:
        text = ""
        if self.tokenizer is not None and sp.detokenize:
            text = self.tokenizer.decode(f.output_token_ids, skip_special_tokens=True)
        logprobs = cumulative = None
        if f.logprobs is not None:
            logprobs, cumulative = [], 0.0
            for tok, table, rank in zip(f.output_token_ids, f.logprobs, f.logprob_ranks):
                entry = {}
                for tid, lp in table.items():
                    entry[tid] = Logprob(logprob=lp, rank=rank if tid == tok else None,
                                         decoded_token=self._decode_one(tid))
                logprobs.append(entry)
                cumulative += table[tok]
        completion = CompletionOutput(index=0, text=text, token_ids=f.output_token_ids,
                                      cumulative_logprob=cumulative, logprobs=logprobs,
                                      finish_reason=f.finish_reason, stop_reason=f.stop_reason)
        return RequestOutput(request_id=f.req_id, prompt=prompt,
                             prompt_token_ids=f.prompt_token_ids, outputs=[completion],
                             num_preemptions=f.num_preemptions)

    def _decode_one(self, token_id: int) -> Optional[str]:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    # ---- engine --------------------------------------------------------------------------
    def stats(self) -> dict:
        return ray.get(self._driver.stats.remote())

    def metrics_snapshot(self) -> Optional[dict]:
        """Tests only: what the engine's metrics have recorded so far (ray_runtime/metrics.py,
        `EngineMetrics.snapshot`), None with disable_log_stats. To watch the metrics, use
        the Ray dashboard or Prometheus (docs/operations.md)."""
        return ray.get(self._driver.metrics_snapshot.remote())

    def set_fault_hook(self, rank: int, hook) -> None:
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

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # An interrupt must not wait behind the call it interrupted.
        self.shutdown(graceful=exc_type is None or issubclass(exc_type, Exception))
