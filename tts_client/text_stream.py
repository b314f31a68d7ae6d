"""Client side of StreamSynthesize: one bidirectional call that carries contexts whose text is
sent as it is produced (an LLM's tokens), with their audio, word timings and acks coming back.

    async with TTSClient(addr) as c:
        call = c.text_stream()
        await call.open("turn-1", voice="ryan")
        for piece in llm_tokens: await call.text("turn-1", piece)
        await call.end("turn-1")
        async for msg in call: ...   # StreamSynthesizeResponse, msg.context_id says whose
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .audio import chunk_samples
from .messages import set_sampling_and_reference
from .pb.tts.v1 import tts_pb2


def context_config(*, voice: str = "", language: str = "", sample_rate_hz: int = 0,
                   encoding: int = tts_pb2.AUDIO_ENCODING_PCM_S16LE, seed: int | None = None,
                   greedy: bool = False, max_duration_s: float = 0.0, request_id: str = "",
                   reference_audio: bytes | None = None, **sampling) -> tts_pb2.ContextConfig:
    """A ContextConfig; `sampling` takes SamplingParams fields (temperature, top_k, ...)."""
    cfg = tts_pb2.ContextConfig(voice=voice, language=language, encoding=encoding,
                                sample_rate_hz=sample_rate_hz, max_duration_s=max_duration_s,
                                request_id=request_id)
    set_sampling_and_reference(cfg, seed=seed, greedy=greedy, sampling=sampling,
                               reference_audio=reference_audio)
    return cfg


class TextStream:
    """One StreamSynthesize call (a grpc.aio stream-stream call underneath). Writes go out in
    order; iterate the object for the responses of every context."""

    def __init__(self, stub, *, timeout: float | None = None, metadata=()):
        self.call = stub.StreamSynthesize(timeout=timeout, metadata=metadata)

    async def _send(self, context_id: str, **content) -> None:
        await self.call.write(tts_pb2.StreamSynthesizeRequest(context_id=context_id, **content))

    async def open(self, context_id: str, config: tts_pb2.ContextConfig | None = None, **kwargs) -> None:
        """Start a context: `config`, or context_config(**kwargs)."""
        await self._send(context_id, config=config if config is not None else context_config(**kwargs))

    async def text(self, context_id: str, text: str) -> None:
        await self._send(context_id, text=text)

    async def flush(self, context_id: str, flush_id: str = "") -> None:
        await self._send(context_id, flush=tts_pb2.Flush(flush_id=flush_id))

    async def end(self, context_id: str) -> None:
        await self._send(context_id, end=tts_pb2.End())

    async def cancel(self, context_id: str) -> None:
        await self._send(context_id, cancel=tts_pb2.Cancel())

    async def close(self) -> None:
        """No more messages from this side (contexts without `end` are cancelled by the server)."""
        await self.call.done_writing()

    def abort(self) -> None:
        self.call.cancel()

    def __aiter__(self):
        return self.call.__aiter__()

    async def collect(self, until, results: dict | None = None, clock=None) -> dict:
        """Read responses, one ContextResult per context id (into `results` when given), until
        every context in `until` has its `done` or the call ends; chunk arrival times from
        clock() (default 0). Returns the results."""
        results = {} if results is None else results
        until = set(until)
        async for msg in self.call:
            results.setdefault(msg.context_id, ContextResult()).add(msg, clock() if clock else 0.0)
            if all(c in results and results[c].done is not None for c in until):
                break
        return results


@dataclass
class ContextResult:
    """One context's responses gathered: audio, word timings, acks and its `done`."""

    samples: list = field(default_factory=list)
    words: list[tuple[str, int]] = field(default_factory=list)  # (word, sample offset)
    flush_acks: list[str] = field(default_factory=list)
    done: tts_pb2.ContextDone | None = None
    sample_rate: int = 0
    chunk_times: list[float] = field(default_factory=list)  # arrival times (caller's clock)

    def add(self, msg: tts_pb2.StreamSynthesizeResponse, now: float = 0.0) -> None:
        kind = msg.WhichOneof("content")
        if kind == "audio":
            self.samples.append(chunk_samples(msg.audio))
            self.sample_rate = msg.audio.sample_rate_hz
            self.chunk_times.append(now)
        elif kind == "words":
            self.words.extend((w.word, w.sample_offset) for w in msg.words.words)
        elif kind == "flush_ack":
            self.flush_acks.append(msg.flush_ack.flush_id)
        elif kind == "done":
            self.done = msg.done

    @property
    def audio(self) -> np.ndarray:
        return np.concatenate(self.samples) if self.samples else np.zeros(0, np.float32)
