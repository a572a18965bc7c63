"""From the engine's RequestDeltas to RequestOutputs, in the caller's process.

Detokenization, stop strings and n > 1 live here, beside the caller, as in vLLM's frontend:
the engine only commits tokens. A request with stop strings is streamed by the engine; when
its text reaches a stop string the output ends there (finish_reason "stop", stop_reason the
string), the engine request is aborted, and its later deltas are dropped. While a request
streams, the last len(longest stop) - 1 characters are held back, so that no partial stop
string is ever shown. A prompt with n > 1 runs as n engine requests, `{i}_{request_id}`;
child i samples with seed + i when a seed is given.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import msgspec

from ray_runtime.detokenizer import IncrementalDetokenizer
from ray_runtime.messages import RequestDelta
from ray_runtime.outputs import CompletionOutput, Logprob, RequestOutput
from ray_runtime.sampling_params import RequestOutputKind, SamplingParams

_CUMULATIVE, _DELTA, _FINAL_ONLY = (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA,
                                    RequestOutputKind.FINAL_ONLY)


class RequestFailed(RuntimeError):
    """The engine failed this request (a stage error, a broken engine); the message says why.
    From LLM.generate, `finished` holds the call's requests that did finish."""

    def __init__(self, message: str, finished: Optional[list] = None) -> None:
        super().__init__(message)
        self.finished: list = finished or []


def child_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


def child_params(sp: SamplingParams, index: int, n: int) -> SamplingParams:
    if n == 1:
        return sp
    child = msgspec.structs.replace(sp, n=1)
    if sp.seed is not None:
        child.seed = sp.seed + index
    return child


@dataclass
class _Child:
    index: int
    sampling: SamplingParams
    detok: Optional[IncrementalDetokenizer]
    stops: list[str]
    hold: int  # characters held back while streaming (a stop string may be starting)
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative: Optional[float] = None
    text: str = ""
    finish_reason: Optional[str] = None
    stop_reason: object = None
    sent_tokens: int = 0  # DELTA: how much was already given to the caller
    sent_text: int = 0
    changed: bool = False


@dataclass
class _Parent:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    children: dict[str, _Child]
    num_preemptions: int = 0
    error: Optional[str] = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}  # by request_id
        self._child_of: dict[str, tuple[_Parent, _Child]] = {}  # by engine request id
        self._dropped: set[str] = set()  # finished here (stop string): later deltas ignored

    def add(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
            sp: SamplingParams, engine_ids: list[str], engine_params: list[SamplingParams]) -> None:
        detok = self.tokenizer is not None and sp.detokenize
        stops = list(sp.stop or ())
        children = {}
        for i, (eid, csp) in enumerate(zip(engine_ids, engine_params)):
            # Held back while streaming: what could be the start of a stop string (nothing
            # when the stop string is shown anyway, as vLLM).
            hold = 0 if sp.include_stop_str_in_output else max(map(len, stops), default=1) - 1
            child = _Child(i, csp, IncrementalDetokenizer(self.tokenizer) if detok else None,
                           stops, hold)
            if sp.logprobs is not None:
                child.logprobs, child.cumulative = [], 0.0
            children[eid] = child
        parent = _Parent(request_id, prompt, list(prompt_token_ids), sp.output_kind, children)
        self._parents[request_id] = parent
        for eid, child in children.items():
            self._child_of[eid] = (parent, child)

    def in_use(self, engine_ids: list[str]) -> Optional[str]:
        """One of these engine request ids that a running request already uses, or None
        (a request "x" with n=2 runs as "0_x" and "1_x")."""
        return next((e for e in engine_ids if e in self._child_of or e in self._dropped), None)

    def engine_ids(self, request_id: str) -> list[str]:
        p = self._parents.get(request_id)
        return [] if p is None else [e for e, c in p.children.items() if c.finish_reason is None]

    def process(self, deltas: list[RequestDelta]) -> tuple[list[RequestOutput], list[str]]:
        """The outputs the deltas make (at most one per request), and the engine ids to
        abort (stop strings reached). A failed request's output raises RequestFailed when
        the caller takes it (`result`)."""
        touched: dict[str, _Parent] = {}
        aborts: list[str] = []
        for d in deltas:
            if d.req_id in self._dropped:
                if d.finished:
                    self._dropped.discard(d.req_id)
                continue
            entry = self._child_of.get(d.req_id)
            if entry is None:
                continue
            parent, child = entry
            touched[parent.request_id] = parent
            if d.error is not None:
                parent.error = d.error
            parent.num_preemptions = max(parent.num_preemptions, d.num_preemptions)
            if self._commit(child, d) and not d.finished:  # a stop string: stop the request
                aborts.append(d.req_id)
                self._dropped.add(d.req_id)
            if child.finish_reason is not None:
                del self._child_of[d.req_id]
        outs = []
        for parent in touched.values():
            out = self._output(parent)
            if out is not None:
                outs.append(out)
            if parent.finished or parent.error is not None:
                self._forget(parent)
        return outs, aborts

    def fail_all(self, why: str) -> list[RequestOutput]:
        outs = []
        for parent in list(self._parents.values()):
            parent.error = why
            for c in parent.children.values():
                c.finish_reason = c.finish_reason or "abort"
            outs.append(self._output(parent))
            self._forget(parent)
        return outs

    def forget(self, request_id: str) -> None:
        """The caller stopped listening to this request: its later deltas are dropped."""
        p = self._parents.get(request_id)
        if p is None:
            return
        for eid, c in p.children.items():
            if c.finish_reason is None:
                self._dropped.add(eid)
        self._forget(p)

    def _forget(self, parent: _Parent) -> None:
        self._parents.pop(parent.request_id, None)
        for eid in parent.children:
            self._child_of.pop(eid, None)

    # ---- one child -----------------------------------------------------------------------
    def _commit(self, c: _Child, d: RequestDelta) -> bool:
        """Take a delta's tokens; True if a stop string ended the child here."""
        c.changed = True
        lps = d.logprobs
        stream_text = c.detok is not None and c.sampling.output_kind != _FINAL_ONLY
        for j, tok in enumerate(d.new_token_ids):
            c.token_ids.append(tok)
            if lps is not None and c.logprobs is not None:
                table = lps[j]
                c.logprobs.append({tid: Logprob(lp, d.logprob_ranks[j] if tid == tok else None,
                                                self._decode_one(tid))
                                   for tid, lp in table.items()})
                c.cumulative += table[tok]
            if c.stops and c.detok is not None:  # one token at a time: stop where it matches
                before = len(c.text)
                c.text += c.detok.push([tok])
                if self._check_stop(c, before):
                    return True
        if c.detok is not None and not c.stops:
            if stream_text:
                c.text += c.detok.push(d.new_token_ids)
            elif d.finished:  # one decode of the whole: the text equals decode(token_ids)
                c.text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        if d.finished:
            if c.detok is not None and (stream_text or c.stops):
                before = len(c.text)
                c.text += c.detok.finish()
                if c.stops:
                    self._check_stop(c, before)
            if c.finish_reason is None:
                c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        return False

    @staticmethod
    def _check_stop(c: _Child, before: int) -> bool:
        """Whether the text added after `before` completes a stop string; if so the text
        ends there (with the stop string if include_stop_str_in_output)."""
        start = max(0, before - c.hold)
        best = None
        for s in c.stops:
            i = c.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        c.text = c.text[:i + len(s)] if c.sampling.include_stop_str_in_output else c.text[:i]
        c.finish_reason, c.stop_reason = "stop", s
        return True

    def _decode_one(self, token_id: int) -> Optional[str]:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    # ---- outputs -------------------------------------------------------------------------
    def _output(self, p: _Parent) -> Optional[RequestOutput]:
        finished = p.finished or p.error is not None
        if p.kind == _FINAL_ONLY and not finished:
            return None
        completions = []
        for c in p.children.values():
            if p.kind == _DELTA and not c.changed:
                continue
            c.changed = False
            done = c.finish_reason is not None
            shown = len(c.text) if done or not c.stops else max(c.sent_text, len(c.text) - c.hold)
            if p.kind == _DELTA:
                text, toks = c.text[c.sent_text:shown], c.token_ids[c.sent_tokens:]
                lps = c.logprobs[c.sent_tokens:] if c.logprobs is not None else None
            else:
                text, toks, lps = c.text[:shown], list(c.token_ids), \
                    (list(c.logprobs) if c.logprobs is not None else None)
            c.sent_text, c.sent_tokens = shown, len(c.token_ids)
            completions.append(CompletionOutput(c.index, text, toks, c.cumulative, lps,
                                                c.finish_reason, c.stop_reason))
        out = RequestOutput(request_id=p.request_id, prompt=p.prompt,
                            prompt_token_ids=p.prompt_token_ids, outputs=completions,
                            finished=finished, num_preemptions=p.num_preemptions)
        out.error = p.error
        return out


def result(out: RequestOutput) -> RequestOutput:
    """The output, or RequestFailed if the engine failed its request."""
    if out.error is not None:
        raise RequestFailed(out.error)
    return out
