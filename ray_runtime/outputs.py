"""RequestOutput and friends, shaped like vLLM's so that user code carries over."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[dict[int, Logprob]]]
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None] = None  # the stop token id or stop string

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_preemptions: int = 0
    metrics: dict = field(default_factory=dict)
    error: Optional[str] = None  # why the engine failed this request, if it did
