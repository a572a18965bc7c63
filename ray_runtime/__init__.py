"""A Ray-distributed pipeline-parallel LLM inference runtime."""
from ray_runtime.api import LLM
from ray_runtime.outputs import CompletionOutput, Logprob, RequestOutput
from ray_runtime.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
