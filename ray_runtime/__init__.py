"""A Ray-distributed pipeline-parallel LLM inference runtime."""
from ray_runtime.api import LLM
from ray_runtime.async_llm import AsyncLLM
from ray_runtime.output_processor import RequestFailed
from ray_runtime.outputs import CompletionOutput, Logprob, RequestOutput
from ray_runtime.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", "Logprob", "RequestFailed"]
