"""A StreamSynthesize context's text on the engine thread: deltas -> committed token ids, how many
of them the engine holds, and the words and flushes whose text has entered the talker.

Token i of the text enters the talker with frame i (token 0 is in the prefill; token i >= 1 is the
text-track vector of the step that makes frame i's code 0), so "entered" is `num_frames >= i`.
Torch-free: the scheduler reads `is_dry`."""

from __future__ import annotations

import bisect
import re
import time

from ..api import TextEvent
from ..model.text_deltas import TextDeltas

_WORD = re.compile(r"\S+")


class TextTrack:
    def __init__(self, tokenizer, max_chars: int | None = None, lock=None):
        self.deltas = TextDeltas(tokenizer, max_chars, lock)
        self.fed = 0  # ids in the engine: ids[0] in the prefill, ids[1:fed] on the text track
        self.closed = False  # the engine has the tts_eos vector (and its EOS gate) too
        self.last_input_at = time.monotonic()
        self._flushes: list[tuple[int, str]] = []  # (ids committed at the flush, its id)
        self._words: list[tuple[str, int]] = []  # complete words (text, first token index)
        self._scan = 0  # text index where the next word starts to be looked for
        self._flushed_to = 0  # text index of the last flush: words before it are complete

    @property
    def ids(self) -> list[int]:
        return self.deltas.ids

    @property
    def ended(self) -> bool:
        return self.deltas.ended

    @property
    def text(self) -> str:
        return self.deltas.text

    @property
    def ready(self) -> bool:
        """Enough text for a prefill: the first token (or the text has ended)."""
        return bool(self.deltas.ids) or self.deltas.ended

    def apply(self, event: TextEvent) -> None:
        """One client event; raises ValueError for a text that breaks the limits."""
        self.last_input_at = time.monotonic()
        if event.kind == "text":
            self.deltas.feed(event.value)
        elif event.kind == "flush":
            self.deltas.flush()
            self._flushed_to = len(self.deltas.text)
            self._flushes.append((len(self.deltas.ids), event.value))
        elif event.kind == "end":
            self.deltas.end()
        else:
            raise ValueError(f"unknown text event {event.kind!r}")
        self._find_words()

    def is_dry(self, num_frames: int) -> bool:
        """The next frame needs a text vector the engine does not have yet: the stream waits."""
        return not self.closed and num_frames >= self.fed - 1

    def words_entered(self, num_frames: int) -> list[tuple[str, int]]:
        """Complete words whose first token has entered the talker: (word, token index)."""
        n = 0
        while n < len(self._words) and self._words[n][1] <= num_frames:
            n += 1
        out, self._words = self._words[:n], self._words[n:]
        return out

    def flushes_entered(self, num_frames: int) -> list[str]:
        """Ids of the flushes all of whose text has entered the talker."""
        n = 0
        while n < len(self._flushes) and self._flushes[n][0] - 1 <= num_frames:
            n += 1
        out, self._flushes = [f for _, f in self._flushes[:n]], self._flushes[n:]
        return out

    def _find_words(self) -> None:
        text, ends = self.deltas.text, self.deltas.ends
        while True:
            m = _WORD.search(text, self._scan)
            if m is None:
                return
            complete = m.end() < len(text) or self.deltas.ended or m.end() <= self._flushed_to
            first = bisect.bisect_right(ends, m.start())  # the first token ending past its start
            if not complete or first >= len(ends):
                return
            self._words.append((m.group(), first))
            self._scan = m.end()
