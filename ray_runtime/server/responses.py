"""RequestOutputs -> OpenAI response bodies and stream chunks (plain dicts, JSON-ready).

One Responder per HTTP request: it knows the response id, the model name, the endpoint
(completion or chat) and what the request asked to see (logprobs, token ids), and keeps the
per-choice state a stream needs (the text offset of completions logprobs, whether a chat
choice has sent its role). A choice's index is prompt_index * n + the sample's index, as
OpenAI and vLLM number them.
"""
from __future__ import annotations

import json
import time
from typing import Optional

from ray_runtime.outputs import CompletionOutput, Logprob, RequestOutput


def sse(payload: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _token_str(tid: int, lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{tid}"


def _top(entries: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(entries.items(), key=lambda kv: -kv[1].logprob)[:k]


class Responder:
    def __init__(self, request_id: str, model: str, chat: bool, n: int, top_k: Optional[int],
                 return_token_ids: bool) -> None:
        self.id, self.model, self.chat, self.n = request_id, model, chat, n
        self.created = int(time.time())
        self.top_k = top_k  # logprobs asked for: the top k of each position (None: none)
        self.return_token_ids = return_token_ids
        self._offsets: dict[int, int] = {}  # completions logprobs: text offset per choice
        self._role_sent: set[int] = set()  # chat streams: choices that sent their role
        self.prompt_tokens: dict[int, int] = {}  # per prompt
        self.completion_tokens = 0

    # ---- pieces --------------------------------------------------------------------------
    def _logprobs(self, index: int, c: CompletionOutput) -> Optional[dict]:
        if self.top_k is None or c.logprobs is None:
            return None
        toks = c.token_ids[len(c.token_ids) - len(c.logprobs):] if c.logprobs else []
        if self.chat:
            content = []
            for tid, entries in zip(toks, c.logprobs):
                chosen = entries[tid]
                s = _token_str(tid, chosen)
                content.append({"token": s, "logprob": chosen.logprob, "bytes": list(s.encode()),
                                "top_logprobs": [
                                    {"token": _token_str(t, lp), "logprob": lp.logprob,
                                     "bytes": list(_token_str(t, lp).encode())}
                                    for t, lp in _top(entries, self.top_k)]})
            return {"content": content}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self._offsets.get(index, 0)
        for tid, entries in zip(toks, c.logprobs):
            s = _token_str(tid, entries[tid])
            out["tokens"].append(s)
            out["token_logprobs"].append(entries[tid].logprob)
            top: dict[str, float] = {}
            for t, lp in _top(entries, self.top_k):  # two ids may decode alike: keep the best
                top.setdefault(_token_str(t, lp), lp.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(s)
        self._offsets[index] = offset
        return out

    def _choice(self, prompt_index: int, out: RequestOutput, c: CompletionOutput,
                stream: bool) -> dict:
        index = prompt_index * self.n + c.index
        choice: dict = {"index": index}
        if self.chat:
            key = "delta" if stream else "message"
            msg: dict = {}
            if not stream or index not in self._role_sent:
                msg["role"] = "assistant"
                self._role_sent.add(index)
            if c.text or not stream:
                msg["content"] = c.text
            choice[key] = msg
        else:
            choice["text"] = c.text
        choice["logprobs"] = self._logprobs(index, c)
        choice["finish_reason"] = c.finish_reason
        choice["stop_reason"] = c.stop_reason
        if self.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        return choice

    def _count(self, prompt_index: int, out: RequestOutput) -> None:
        """Usage: a final output's tokens, or a streamed delta's (they add up)."""
        self.prompt_tokens[prompt_index] = len(out.prompt_token_ids)
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)

    def usage(self) -> dict:
        p = sum(self.prompt_tokens.values())
        return {"prompt_tokens": p, "completion_tokens": self.completion_tokens,
                "total_tokens": p + self.completion_tokens}

    def _envelope(self, stream: bool) -> dict:
        obj = ("chat.completion" if self.chat else "text_completion") + \
            (".chunk" if stream and self.chat else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # ---- whole responses -----------------------------------------------------------------
    def final(self, outs: list[RequestOutput]) -> dict:
        """The non-streamed response: one finished RequestOutput per prompt, in order."""
        choices = []
        for p, out in enumerate(outs):
            self._count(p, out)
            choices.extend(self._choice(p, out, c, stream=False)
                           for c in sorted(out.outputs, key=lambda c: c.index))
        body = {**self._envelope(False), "choices": choices, "usage": self.usage()}
        if self.return_token_ids:
            body["prompt_token_ids"] = [list(o.prompt_token_ids) for o in outs] \
                if len(outs) > 1 else list(outs[0].prompt_token_ids)
        return body

    def chunk(self, prompt_index: int, out: RequestOutput) -> Optional[dict]:
        """A stream chunk for one DELTA output, or None when it shows nothing new."""
        self._count(prompt_index, out)
        choices = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            new = c.text or c.finish_reason is not None or (c.token_ids and (
                self.return_token_ids or (self.top_k is not None and c.logprobs)))
            if not new and not (self.chat and index not in self._role_sent):
                continue  # a held-back stop string or a partial character: nothing to show
            choices.append(self._choice(prompt_index, out, c, stream=True))
        if not choices:
            return None
        return {**self._envelope(True), "choices": choices}

    def usage_chunk(self) -> dict:
        return {**self._envelope(True), "choices": [], "usage": self.usage()}
