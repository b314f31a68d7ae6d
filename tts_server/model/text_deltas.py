"""Tokenize text that arrives in pieces so that the ids equal the whole text's tokenization.

The whole text is tokenized as `Synthesize` tokenizes it: "<|im_start|>assistant\\n{text}<|im_end|>..."
with `text` stripped. A later delta can change only the tail: the last pre-token (a BPE word:
letters run on, "'" may become "'s", a whitespace run ends differently), combining marks that NFC
composes with the last starter, a half-typed special token, and trailing whitespace that the final
strip removes. `TextDeltas` commits the tokens before that tail and holds the tail back until the
next delta, `flush` (commit everything now: a hard boundary) or `end`.
"""

from __future__ import annotations

import contextlib
import unicodedata

ROLE_PREFIX = "<|im_start|>assistant\n"  # the 3 role tokens that precede the text
ROLE_TOKENS = 3
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"  # the 5 tokens that follow it
SUFFIX_TOKENS = 5


class TextDeltas:
    """One context's text: deltas in, committed token ids (and their text offsets) out.

    `ids[i]` ends at character `ends[i]` of `text` (the received text, leading whitespace
    dropped); a token committed once never changes. Not thread-safe: one owner."""

    def __init__(self, tokenizer, max_chars: int | None = None, lock=None):
        self._bt = getattr(tokenizer, "backend_tokenizer", tokenizer)  # a `tokenizers.Tokenizer`
        self._lock = lock or contextlib.nullcontext()  # the tokenizer's, when others share it
        specials = [t.content for t in self._bt.get_added_tokens_decoder().values()]
        self._prefixes = {sp[:k] for sp in specials for k in range(1, len(sp))}  # proper prefixes
        self._max_prefix = max(map(len, self._prefixes), default=0)
        self.max_chars = max_chars
        self.text = ""
        self.ids: list[int] = []
        self.ends: list[int] = []
        self.ended = False
        self._base = 0  # start of the current segment in `text` (a flush, or a restart point)
        self._starts: list[int] = []  # start offsets of the last encoding's tokens
        self._seg_done = 0  # tokens of the current segment already committed
        self._first = True  # the first segment is tokenized after ROLE_PREFIX, as Synthesize does

    # ---- input ----------------------------------------------------------------------------
    def feed(self, delta: str) -> list[int]:
        """Append `delta`; returns the ids it committed (possibly none)."""
        if self.ended:
            raise ValueError("text after end")
        if not self.text:
            delta = delta.lstrip()
        self.text += delta
        if self.max_chars is not None and len(self.text.rstrip()) > self.max_chars:
            raise ValueError(f"{len(self.text.rstrip())} characters exceeds the limit of {self.max_chars}")
        ids, ends, words = self._encode(final=False)
        n = self._stable(ids, ends, words)
        out = self._commit(ids, ends, n)
        if out and n < len(ids) and self._starts[n] == ends[n - 1]:
            self._restart(ends[n - 1])
        return out

    def flush(self) -> list[int]:
        """Commit the held-back tail now (the text so far ends a segment; trailing whitespace
        is kept), and start a new segment for later deltas."""
        if self.ended:
            return []
        ids, ends, _ = self._encode(final=False)
        out = self._commit(ids, ends, len(ids))
        if self.text[self._base:]:
            self._base, self._seg_done, self._first = len(self.text), 0, False
        return out

    def end(self) -> list[int]:
        """No more text: commit the rest, tokenized as the end of the whole text."""
        if self.ended:
            return []
        stripped = self.text.rstrip()
        if len(stripped) >= self._base:
            self.text = stripped
        ids, ends, _ = self._encode(final=True)
        out = self._commit(ids, ends, len(ids))
        self.ended = True
        return out

    # ---- internals ------------------------------------------------------------------------
    def _encode(self, final: bool) -> tuple[list[int], list[int], list[int]]:
        """The current segment's ids, their end offsets in `text` and their pre-token indices."""
        seg = self.text[self._base:]
        if not seg:
            return [], [], []
        prefix = ROLE_PREFIX if self._first else ""
        with self._lock:
            enc = self._bt.encode(prefix + seg + (SUFFIX if final else ""), add_special_tokens=False)
        lo = ROLE_TOKENS if self._first else 0
        hi = len(enc.ids) - (SUFFIX_TOKENS if final else 0)
        shift = self._base - len(prefix)
        words, last = [], -1
        for w in enc.word_ids[lo:hi]:
            last = last if w is None else w
            words.append(last)
        ends = [min(max(e + shift, self._base), len(self.text)) for _, e in enc.offsets[lo:hi]]
        self._starts = [b + shift for b, _ in enc.offsets[lo:hi]]
        return list(enc.ids[lo:hi]), ends, words

    def _stable(self, ids: list[int], ends: list[int], words: list[int]) -> int:
        """How many leading ids no further delta can change."""
        if not ids:
            return 0
        seg = self.text[self._base:]
        cut = len(seg.rstrip())  # trailing whitespace: the final strip may remove it
        i = cut
        while i > 0 and unicodedata.combining(seg[i - 1]):  # marks NFC may compose with a starter
            i -= 1
        if i < cut:
            cut = max(i - 1, 0)
        for n in range(min(self._max_prefix, len(seg)), 0, -1):  # a special token being typed
            if seg[-n:] in self._prefixes:  # ("<|im_" ... "end|>") ends the text before it once
                # complete: hold back the whitespace and the word before it too
                cut = min(cut, max(len(seg[:len(seg) - n].rstrip()) - 1, 0))
                break
        cut += self._base
        held = words[-1]  # the last pre-token can always grow
        for w, e in zip(words, ends):
            if e > cut:
                held = min(held, w)
                break
        n = 0
        while n < len(ids) and words[n] < held:
            n += 1
        return n

    def _restart(self, c: int) -> None:
        """Tokenize from text[c:] on (c ends a committed pre-token, so the regex split, BPE and
        the special tokens after it are as in the whole text; not before a combining mark, which
        NFC might compose across c): each delta then costs its tail, not the whole text again."""
        if self._base < c < len(self.text) and not unicodedata.combining(self.text[c]):
            self._base, self._seg_done, self._first = c, 0, False

    def _commit(self, ids: list[int], ends: list[int], n: int) -> list[int]:
        done = self._seg_done
        start = len(self.ids) - done
        if ids[:done] != self.ids[start:]:  # a bug in the hold-back rules, never the client's
            raise RuntimeError(f"tokenization across deltas diverged after token {start}: "
                               f"committed {self.ids[start:]}, now {ids[:done]}")
        n = max(n, done)
        new = ids[done:n]
        self.ids.extend(new)
        self.ends.extend(ends[done:n])
        self._seg_done = n
        return new
