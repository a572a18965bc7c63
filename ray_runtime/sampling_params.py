"""SamplingParams: what one request asks of the sampler and of the stop checks.

Validated on construction and again by validate_request, in the caller's process, so that bad
input is a ValueError (an InputTypeError, also a TypeError, for a wrong type) naming the field
before anything reaches the cluster. Every field is converted to the plain type it has on the
wire (numpy numbers become int / float) and bounded to what msgpack carries (signed 64-bit
ints, finite floats).
"""
from __future__ import annotations

import enum
from typing import Optional, Union

import msgspec

from ray_runtime.checks import INT64_MAX, as_bool, as_float, as_int, as_int_list, as_str_list

# vLLM's _SAMPLING_EPS: a temperature below it is greedy sampling. Dividing logits by a smaller
# one overflows float32 to inf, and softmax of inf - inf is NaN.
SAMPLING_EPS = 1e-5
MAX_N = 128  # parallel samples of one prompt
# Stop strings are matched against the detokenized text after every token: bound the work.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024


class RequestOutputKind(enum.IntEnum):
    """vLLM's names: what each RequestOutput of a streamed request carries."""

    CUMULATIVE = 0  # everything so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # nothing until the request finishes (LLM.generate)


class SamplingParams(msgspec.Struct, kw_only=True):
    """Same meaning as vLLM's SamplingParams for the fields it shares with it.

    temperature < SAMPLING_EPS (1e-5), 0 included, is greedy (argmax; top_p, top_k, min_p and
    seed are then ignored), as in vLLM.

    Penalties (vLLM's): repetition_penalty divides the positive logits and multiplies the
    negative ones of every token in the prompt or the output so far (1 = off);
    frequency_penalty subtracts itself times each token's count in the output so far, and
    presence_penalty itself once from each token the output holds (0 = off). They apply to the
    logits before temperature, top-k, top-p, min-p and the greedy argmax; logprobs stay those
    of the raw logits. `n`, `stop` and `include_stop_str_in_output` are carried for the API
    layer, which expands n and matches stop strings on the text (not in the output unless
    include_stop_str_in_output). `stop` is normalized to a list of strs ([] for None)."""

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
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None  # a list after validate()
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field and convert it in place to its wire type (InputTypeError for a
        wrong type, ValueError for a value out of range). Idempotent, and cheap: the stages run it
        again on decoding."""
        f = "SamplingParams."
        self.max_tokens = as_int(self.max_tokens, f + "max_tokens", 1, INT64_MAX, ">= 1")
        self.temperature = as_float(self.temperature, f + "temperature", lambda t: t >= 0.0,
                                    ">= 0 (below 1e-5: greedy)")
        self.top_p = as_float(self.top_p, f + "top_p", lambda p: 0.0 < p <= 1.0, "in (0, 1]")
        self.top_k = as_int(self.top_k, f + "top_k", -1, INT64_MAX,
                            "-1, 0 (disabled) or positive")
        self.min_p = as_float(self.min_p, f + "min_p", lambda p: 0.0 <= p <= 1.0, "in [0, 1]")
        if self.seed is not None:
            self.seed = as_int(self.seed, f + "seed",
                               limits="in [-2**63, 2**63 - 1] (signed 64-bit) or None")
        self.ignore_eos = as_bool(self.ignore_eos, f + "ignore_eos")
        self.stop_token_ids = as_int_list(self.stop_token_ids, f + "stop_token_ids", 0,
                                          INT64_MAX, "[0, 2**63)")
        if self.logprobs is not None:
            self.logprobs = as_int(self.logprobs, f + "logprobs", 0, 20, "in [0, 20] or None")
        self.detokenize = as_bool(self.detokenize, f + "detokenize")
        self.n = as_int(self.n, f + "n", 1, MAX_N, f"in [1, {MAX_N}]")
        self.stop = as_str_list(self.stop, f + "stop", MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS)
        self.include_stop_str_in_output = as_bool(self.include_stop_str_in_output,
                                                  f + "include_stop_str_in_output")
        self.presence_penalty = as_float(self.presence_penalty, f + "presence_penalty",
                                         lambda p: -2.0 <= p <= 2.0, "in [-2, 2]")
        self.frequency_penalty = as_float(self.frequency_penalty, f + "frequency_penalty",
                                          lambda p: -2.0 <= p <= 2.0, "in [-2, 2]")
        self.repetition_penalty = as_float(self.repetition_penalty, f + "repetition_penalty",
                                           lambda p: 0.0 < p <= 2.0, "in (0, 2]")
        self.output_kind = RequestOutputKind(as_int(
            self.output_kind, f + "output_kind", 0, 2, "a RequestOutputKind (0, 1 or 2)"))

    @property
    def is_greedy(self) -> bool:
        """Argmax sampling: temperature below SAMPLING_EPS (vLLM's convention), 0 included."""
        return self.temperature < SAMPLING_EPS

    @property
    def needs_host_sample(self) -> bool:
        """Whether a step's sample for this request must reach the host at once: for its
        logprobs, or for the token history its penalties read (stages/last_rank.py)."""
        return self.logprobs is not None or self.uses_penalties

    @property
    def uses_penalties(self) -> bool:
        """Whether any penalty changes the logits (the sampler then needs the token history)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or \
            self.repetition_penalty != 1.0

    @property
    def effective_top_k(self) -> int:
        return 0 if self.top_k in (-1, 0) else self.top_k
