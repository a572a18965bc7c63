"""Incremental detokenization: text as tokens arrive, right across multi-byte characters.

A character can span several tokens (byte-level BPE): decoding a token alone gives U+FFFD.
So text is taken from a window of tokens, `ids[prefix:]`, minus what the already-read part of
the window, `ids[prefix:read]`, decodes to; while the window's text ends in U+FFFD the
character is incomplete and nothing is emitted yet. Once text is emitted the window slides
to start where the last read ended. `finish` flushes what is left, so the concatenated text
equals `tokenizer.decode(all ids, skip_special_tokens=...)` for the tokenizers we serve
(byte-level BPE and SentencePiece windows alike: a window never starts mid-word spacing
differently from the full decode, because it starts at a token boundary already decoded).
"""
from __future__ import annotations

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # where the decode window starts
        self.read = 0  # ids before this are already text
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        """Take new token ids; return the text they complete (possibly empty)."""
        self.ids.extend(token_ids)
        return self._advance(final=False)

    def finish(self) -> str:
        """The text of any incomplete character left at the end, as decode gives it."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read >= len(self.ids):
            return ""
        window = self._decode(self.ids[self.prefix:])
        if window.endswith(_REPLACEMENT) and not final:
            return ""
        known = self._decode(self.ids[self.prefix:self.read]) if self.read > self.prefix else ""
        new = window[len(known):] if window.startswith(known) else window
        self.prefix, self.read = self.read, len(self.ids)
        self.text += new
        return new
