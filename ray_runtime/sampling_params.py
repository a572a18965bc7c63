"""SamplingParams: what one request asks of the sampler and of the stop checks.

Validated on construction, in the caller's process, so that bad input is a ValueError
naming the field before anything reaches the cluster.
"""
from __future__ import annotations

import math
from typing import Optional

import msgspec


class SamplingParams(msgspec.Struct, kw_only=True):
    """Same meaning as vLLM's SamplingParams for the fields it shares with it."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: Optional[int] = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: Optional[int] = None  # None: none; n >= 0: the chosen token plus the top n
    detokenize: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{field} {why}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) \
                or self.temperature < 0 or math.isinf(self.temperature):
            raise bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or math.isnan(self.top_p) \
                or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 0 and self.top_k != -1):
            raise bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or math.isnan(self.min_p) \
                or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer or None, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", f"must be None or an integer in [0, 20], got {self.logprobs!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def effective_top_k(self) -> int:
        return 0 if self.top_k in (-1, 0) else self.top_k
