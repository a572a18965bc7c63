"""OpenAI's request bodies for /v1/completions and /v1/chat/completions, checked, and turned
into prompts and SamplingParams; OpenAI-shaped errors.

Types are strict (a bool is not an int, "0.5" is not a number), as everywhere in this
project; ranges are SamplingParams' own checks (ray_runtime/sampling_params.py), so the server
and the Python API accept the same values. Every bad field is a RequestError (HTTP 400) whose
`param` names it. Unknown fields are ignored with a warning, as vLLM does; fields OpenAI
defines that this engine cannot honour (echo, suffix, best_of != n, logit_bias, tools,
response_format other than text) are a 400 saying so, never silently dropped.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from ray_runtime.checks import show
from ray_runtime.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# The penalties another change adds to SamplingParams: passed through once the field
# exists there; until then a non-neutral value is a 400 saying so.
PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


class RequestError(ValueError):
    """A bad request: HTTP `status` with OpenAI's error body naming `param`."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.err_type = message, param, status, err_type

    def body(self) -> dict:
        return error_body(self.message, self.param, self.status, self.err_type)


def error_body(message: str, param: Optional[str] = None, status: int = 400,
               err_type: str = "BadRequestError") -> dict:
    """vLLM's error shape (OpenAI's, with the HTTP status as `code`)."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


_TYPE_TAGS = {"str", "int", "float", "bool", "none"}


def from_validation_error(e: ValidationError) -> RequestError:
    """The first field pydantic rejected, as a 400 naming it (`messages.0.content`)."""
    err = e.errors()[0]
    parts = []
    for x in err["loc"]:  # stop at pydantic's union tags ("str", "list[str]")
        if isinstance(x, int) or (re.fullmatch(r"[A-Za-z_]\w*", x) and x not in _TYPE_TAGS):
            parts.append(str(x))
        else:
            break
    param = ".".join(parts) or None
    if err["type"] == "missing":
        return RequestError(f"{param}: required", param)
    return RequestError(f"{param}: {err['msg']}, got {show(err.get('input'))}", param)


_SP_FIELD = re.compile(r"SamplingParams\.(\w+)")


def from_engine_error(e: Exception, renames: dict[str, str], prompt_param: str) -> RequestError:
    """A ValueError/TypeError from SamplingParams or the engine's request checks, as a 400
    with OpenAI's field name: `SamplingParams.top_p ...` -> top_p, `prompts[i]: ...` ->
    prompt_param."""
    msg = str(e)
    m = _SP_FIELD.search(msg)
    if m:
        name = renames.get(m.group(1), m.group(1))
        return RequestError(_SP_FIELD.sub(lambda mm: renames.get(mm.group(1), mm.group(1)), msg),
                            name)
    if msg.startswith("prompts["):
        return RequestError(prompt_param + msg[len("prompts"):], prompt_param)
    return RequestError(msg, None)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """The fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    # vLLM's extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False  # each choice gets token_ids, and prompt_token_ids

    def check_common(self) -> None:
        if self.model_extra:
            logger.warning("ignored unknown request fields: %s", sorted(self.model_extra))
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options: only allowed when stream is true",
                               "stream_options")
        if self.logit_bias:
            raise RequestError("logit_bias: not supported by this server", "logit_bias")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(s == "" for s in stops):
            raise RequestError("stop: stop strings must be non-empty", "stop")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, logprobs: Optional[int],
                        renames: dict[str, str]) -> SamplingParams:
        """SamplingParams for this request (DELTA when streaming, else FINAL_ONLY); a bad
        value is a RequestError naming the field as the request spelled it."""
        kw: dict[str, Any] = dict(
            max_tokens=max_tokens, n=self.n, ignore_eos=self.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if self.stop is not None:
            kw["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        for name, neutral in PENALTIES.items():
            value = getattr(self, name)
            if value is None:
                continue
            if name in SamplingParams.__struct_fields__:
                kw[name] = value
            elif value != neutral:
                raise RequestError(f"{name}: not supported yet by this engine (only the neutral "
                                   f"value {neutral} is accepted), got {value!r}", name)
        try:
            return SamplingParams(**kw)
        except (TypeError, ValueError) as e:
            raise from_engine_error(e, renames, "prompt") from None


class CompletionRequest(_SamplingRequest):
    prompt: Any = None
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def check(self) -> None:
        self.check_common()
        if self.echo:
            raise RequestError("echo: not supported by this server", "echo")
        if self.suffix:
            raise RequestError("suffix: not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError(f"best_of: only best_of == n is supported, got best_of="
                               f"{self.best_of} with n={self.n}", "best_of")

    def prompts(self) -> list[Union[str, list[int]]]:
        """OpenAI's prompt forms: a string, a list of token ids, or a list of either."""
        p = self.prompt
        doc = "a string, a list of token ids, or a list of strings or of token-id lists"
        if p is None:
            raise RequestError("prompt: required", "prompt")
        if isinstance(p, str):
            return [p]
        if not isinstance(p, list) or not p:
            raise RequestError(f"prompt: must be {doc} (non-empty), got {show(p)}", "prompt")
        if all(_is_int(x) for x in p):
            return [p]
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in p):
            return list(p)
        raise RequestError(f"prompt: must be {doc}, got {show(p)}", "prompt")

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(self.max_tokens if self.max_tokens is not None else 16,
                                    self.logprobs, {})


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class ChatMessage(_Strict):
    role: str
    content: Union[str, list[dict[str, Any]], None] = None

    def text(self, i: int) -> str:
        """The message's content as one string (text parts joined by newlines)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"messages.{i}.content.{j}: only text parts "
                                   f"({{'type': 'text', 'text': ...}}) are supported, got "
                                   f"{show(part)}", f"messages.{i}.content")
            texts.append(part["text"])
        return "\n".join(texts)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None  # OpenAI's deprecated name
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    response_format: Optional[dict[str, Any]] = None

    def check(self) -> None:
        self.check_common()
        if not self.messages:
            raise RequestError("messages: must hold at least one message", "messages")
        if self.tools:
            raise RequestError("tools: not supported by this server", "tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise RequestError("response_format: only {'type': 'text'} is supported",
                               "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs: needs logprobs set to true", "top_logprobs")

    def conversation(self) -> list[dict]:
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = self.max_completion_tokens
        renames = {"logprobs": "top_logprobs"}
        if max_tokens is not None:
            renames["max_tokens"] = "max_completion_tokens"
        else:
            max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs, renames)


def parse(model: type, body: Any):
    """The request model of a JSON body, checked; RequestError for anything wrong."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {show(body)}")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None
    req.check()
    return req
