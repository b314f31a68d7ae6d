"""StreamSynthesize on the engine thread: client text events into each context's `TextTrack`, new
tokens onto the engine's text track, prompts for contexts being admitted, and the word timings
and flush acknowledgements of text that has entered the talker.

A context's prompt uses qwen-tts's streaming-text layout (first token in the prefill, the rest one
per frame); until `end` its track has no tts_eos and its EOS gate is closed, so it can neither end
early nor hear tts_pad: when the text runs dry the scheduler stops stepping it."""

from __future__ import annotations

import dataclasses
import math

import torch

from ..api import (FinishReason, FlushAck, IdleText, InvalidRequest, StreamFailure, WordTiming,
                   default_max_duration_s)
from ..engines.contract import OPEN_TRACK
from ..model.prompt import Prompt, PromptItem
from ..model.text_deltas import ROLE_PREFIX, SUFFIX
from .prepare import Prepared
from .streams import Stream, StreamHandle
from .text_track import TextTrack


class TextFeeder:
    def __init__(self, preparer, engine, idle_timeout_s: float, max_chars: int, frame_samples: int,
                 sample_rate: int, frame_s: float):
        self.preparer, self.engine = preparer, engine
        self.tokenizer = preparer.tts.processor.tokenizer
        self.tokenizer_lock = getattr(preparer, "_tokenizer_lock", None)  # shared with submit()
        self.idle_timeout_s, self.max_chars = idle_timeout_s, max_chars
        self.frame_samples, self.sample_rate, self.frame_s = frame_samples, sample_rate, frame_s
        bt = self.tokenizer.backend_tokenizer  # (start-up: no other thread tokenizes yet)
        self.role_ids = bt.encode(ROLE_PREFIX, add_special_tokens=False).ids
        self.suffix_ids = bt.encode(SUFFIX, add_special_tokens=False).ids

    @property
    def supported(self) -> bool:
        return hasattr(self.engine, "extend_text")

    # ---- client input ---------------------------------------------------------------------
    def drain(self, handles: list[StreamHandle], now: float) -> list[tuple[StreamHandle, FinishReason, Exception]]:
        """Apply every context's pending text events; -> the contexts to end, with why."""
        out = []
        for h in handles:
            if not h.request.incremental or h.cancelled:
                continue
            if h.track is None:
                h.track = TextTrack(self.tokenizer, self.max_chars, self.tokenizer_lock)
            was_ready = h.ready
            try:
                while h.text_events:
                    h.track.apply(h.text_events.popleft())
            except ValueError as e:
                out.append((h, FinishReason.ERROR, InvalidRequest("text", str(e))))
                continue
            except RuntimeError as e:  # the hold-back rules failed: a bug, this context only
                out.append((h, FinishReason.ERROR, StreamFailure(str(e))))
                continue
            if not was_ready and h.ready:
                h.submitted_at = now  # its queue wait starts with its first token
            if not h.track.ended and now - h.track.last_input_at > self.idle_timeout_s:
                out.append((h, FinishReason.IDLE_TIMEOUT, IdleText(
                    f"no text and no end for {self.idle_timeout_s:g} s (--idle-text-timeout-s)")))
        return out

    # ---- admission ------------------------------------------------------------------------
    @torch.inference_mode()
    def prompt(self, handle: StreamHandle) -> tuple[Prepared, int]:
        """The prefill of a ready context from the tokens it has so far -> (prepared, eos_from)."""
        plan, finish = self.plan_prompt(handle)
        return finish(self.preparer.builder.materialise([plan])[0])

    def plan_prompt(self, handle: StreamHandle):
        """`prompt` in two halves, so that a step's contexts build their prompts together: ->
        (the builder's plan, finish(prompt) -> (prepared, eos_from)); `finish` marks the tokens fed."""
        req, track = handle.request, handle.track
        clone = self.preparer._voice(req.reference)[1] if req.reference is not None else None
        if clone is not None and clone.ref_codes is not None:
            raise InvalidRequest("config.reference.transcript", "in-context cloning is not "
                                 "available for incremental text; leave the transcript empty")
        ids = self.role_ids + track.ids + self.suffix_ids  # a list: the builder plans from it
        plan = self.preparer.builder.plan(PromptItem(ids, req.language, req.voice, clone, non_streaming=False))

        def finish(prompt: Prompt) -> tuple[Prepared, int]:
            if not track.ended:  # no tts_eos until the text has ended
                prompt = dataclasses.replace(prompt, trailing=prompt.trailing[:-1])
            track.fed, track.closed = len(track.ids), track.ended
            return Prepared(prompt, None), (len(track.ids) - 1 if track.ended else OPEN_TRACK)
        return plan, finish

    @torch.inference_mode()
    def prompts(self, handles: list[StreamHandle]) -> list[tuple[Prepared, int] | Exception]:
        """`prompt` of several contexts, built together; a context's own error is its entry."""
        out: list = [None] * len(handles)
        planned = []
        for i, h in enumerate(handles):
            try:
                planned.append((i, *self.plan_prompt(h)))
            except Exception as e:  # noqa: BLE001 - this context's own error
                out[i] = e
        built = self.preparer.builder.materialise([p for _, p, _ in planned])
        for (i, _, finish), prompt in zip(planned, built):
            out[i] = finish(prompt)
        return out

    def admitted(self, stream: Stream) -> None:
        if stream.handle.track.closed:
            self._cap(stream)

    # ---- running contexts -----------------------------------------------------------------
    @torch.inference_mode()
    def feed(self, stream: Stream, now: float) -> None:
        """Put the context's new tokens (and, once ended, tts_eos) on its engine text track."""
        track = stream.handle.track
        ids = track.ids
        if track.fed == len(ids) and (track.closed or not track.ended):
            return
        was_dry = stream.text_dry()
        builder = self.preparer.builder
        vectors = builder.text_track(ids[track.fed:], track.fed - 1)  # token i is track entry i - 1
        if track.ended:
            vectors = torch.cat((vectors, builder.eos_vector()))
        self.engine.extend_text(stream.slot, vectors, len(ids) - 1 if track.ended else None)
        track.fed, track.closed = len(ids), track.ended
        if track.closed:
            self._cap(stream)
        if was_dry and stream.first_chunk_at is not None and stream.lead_s(now, self.frame_s) < 0:
            # the player ran dry while the text did: its clock restarts with the next audio
            stream.first_chunk_at = now - stream.frames_emitted * self.frame_s

    def after_frame(self, stream: Stream) -> None:
        """Word timings and flush acks for the text that has now entered the talker."""
        track, handle = stream.handle.track, stream.handle
        rate = handle.request.output_sample_rate
        for word, i in track.words_entered(stream.num_frames):
            handle.post(WordTiming(word, round(i * self.frame_samples * rate / self.sample_rate)))
        for flush_id in track.flushes_entered(stream.num_frames):
            handle.post(FlushAck(flush_id))

    def waiting_acks(self, handle: StreamHandle) -> None:
        """A context not admitted yet: acknowledge the flushes that came before any text."""
        if handle.track is not None:
            for flush_id in handle.track.flushes_entered(-1):
                handle.post(FlushAck(flush_id))

    def _cap(self, stream: Stream) -> None:
        """The text has ended: the runaway guard derived from its length applies."""
        if stream.handle.request.max_frames_from_text:
            seconds = default_max_duration_s(stream.handle.track.text)
            frames = math.floor(seconds * self.sample_rate / self.frame_samples + 1e-3)  # as rpc/convert
            stream.max_frames = min(stream.max_frames, max(1, frames))
