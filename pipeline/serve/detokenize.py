"""Output processing: a request's generated tokens become text as they arrive, and stop strings end it,
with work per token that does not grow with the text.

Decoding goes through a window of offsets into the request's token list (the scheme of vLLM's and
Hugging Face's incremental detokenisers): tokens ``prefix:read`` were given out already and are decoded
again only as context (a SentencePiece decoder drops the leading space of a window's first token, so a
token decoded alone need not read as it does in the whole text); tokens ``read:`` are not given out yet.
Once the window's text is longer than its context's and does not end in an unfinished UTF-8 character
("\\ufffd": byte-level BPE splits a character's bytes over tokens), the new end is given out and the
window moves up to the tokens just read. Of that text, an end that may still become a stop string is
held back; the stop-string search reads only the held-back end and the new text.

The window assumes that a token's text does not change with the tokens after it (byte-level BPE and
SentencePiece decoders); its only growth beyond a step's tokens is a run of invalid bytes, whose text
keeps ending in "\\ufffd". Special tokens that a decode skips are left out of the list, so a run of them
costs nothing.
"""

import functools
from collections.abc import Sequence


class Detokenizer:
    """The text of one request's generated tokens, given out a piece at a time (``add``): the same text as a
    whole decode (``skip_special_tokens=True``) of the tokens, cut before the stop string first complete in it."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        if any(not s for s in stop):
            raise ValueError(f"stop={list(stop)!r}: a stop string must not be empty")
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self._skipped = skipped_ids(tokenizer)
        self.tokens: list[int] = []  # the tokens that make text (skipped special tokens left out)
        self._prefix = 0  # the window's first token: context, given out already
        self._read = 0  # the first token whose text is not given out yet
        self._context = ""  # the text of tokens[prefix:read] decoded alone
        self._held = ""  # text decoded but held back: it may be the start of a stop string
        self.finish: str | None = None

    def add(self, tokens: Sequence[int], finish: str | None = None) -> tuple[str, str | None]:
        """Append ``tokens`` (one or several: a speculative round gives several; no end-of-sequence token)
        and return (the new text to send, finish). ``finish`` says how the tokens ended (None: going on; else
        all the text is given out); a stop string in the text cuts it there and the finish becomes ``stop``."""
        if self.finish is not None:
            raise ValueError(f"tokens {list(tokens)} added after the text finished ({self.finish})")
        before = len(self.tokens)
        self.tokens.extend(t for t in tokens if t not in self._skipped)
        new = ""
        if len(self.tokens) > before or finish is not None:
            text = self.tokenizer.decode(self.tokens[self._prefix:], skip_special_tokens=True)
            if finish is not None:
                new = text[len(self._context):]
            elif len(text) > len(self._context) and not text.endswith("\ufffd"):
                new = text[len(self._context):]
                self._prefix, self._read = self._read, len(self.tokens)
                self._context = self.tokenizer.decode(self.tokens[self._prefix:self._read], skip_special_tokens=True)
        return self._release(self._held + new, finish)

    def _release(self, text: str, finish: str | None) -> tuple[str, str | None]:
        """Cut ``text`` (the held-back end and the new text) at its first stop string, or hold back the end
        that may still become one while the tokens go on."""
        cut = first_stop(text, self.stop)
        if cut is not None:
            text, finish = text[:cut], "stop"
        if finish is not None:
            self._held, self.finish = "", finish
            return text, finish
        keep = len(text) - stop_prefix(text, self.stop)
        self._held = text[keep:]
        return text[:keep], None


def first_stop(text: str, stops: list[str]) -> int | None:
    """Where the stop string completed first in ``text`` (the earliest end; of those, the earliest start)
    starts, or None: the text stops where a stop string first appears, whether its tokens came one at a
    time or several (a speculative round) at once."""
    found = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    return min(found)[1] if found else None


def stop_prefix(text: str, stops: list[str]) -> int:
    """The length of the longest end of ``text`` that begins a stop string (and is not a whole one)."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


@functools.lru_cache(maxsize=8)
def skipped_ids(tokenizer) -> frozenset[int]:
    """The special tokens that ``decode(..., skip_special_tokens=True)`` leaves out, found by decoding each
    candidate (the added tokens, the special tokens): transformers' two backends skip different sets (the
    Rust one every added token marked special, the Python one ``all_special_ids``); once per tokenizer."""
    candidates = set(getattr(tokenizer, "added_tokens_decoder", {})) | set(tokenizer.all_special_ids)
    return frozenset(i for i in candidates
                     if tokenizer.decode([i], skip_special_tokens=True) == "" != tokenizer.decode([i]))
