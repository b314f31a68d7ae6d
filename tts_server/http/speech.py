"""POST /v1/audio/speech: validate, submit to the engine worker, stream the encoded audio.

The status line waits for the stream's first event, so a refusal that comes from the engine (a
queue wait that ran out, a failed prefill) still gets its own status; after that the audio goes
out as it is decoded (chunked body, or SSE `speech.audio.delta` events). A failure mid-stream
cuts the connection without the final chunk (SSE: an `error` event), so no client takes a cut
stream for a complete one. The slot is freed as soon as the handler exits: a client hang-up
cancels it (aiohttp's handler cancellation), a client that stops reading blocks the write
(TCP flow control) until the engine pauses the stream and `--stall-timeout-s` ends it."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import socket
import time

from aiohttp import web

from .. import aio
from ..api import AudioChunk, FinishReason, StreamEnd
from ..audio_formats import AudioEncoder
from ..logs import request_id_var
from . import speech_request
from .errors import APIError, from_exception, invalid

log = logging.getLogger(__name__)

SEND_BUFFER_BYTES = 128 * 1024  # per connection (Linux doubles it): 2.7 s of 48 kHz PCM16


class _Cut(Exception):
    """The connection was closed mid-stream (the client hung up or stopped reading, or the
    stream failed); the argument is the call's status name for the metrics."""


class SpeechHandler:
    def __init__(self, worker, info, config):
        self.worker, self.info, self.config = worker, info, config
        self.metrics = worker.metrics
        self.stalls = aio.StallWatch(config.stall_timeout_s)

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        code = "OK"
        try:
            return await self._speech(request)
        except (APIError, web.HTTPException) as e:  # the latter: 413 from aiohttp's body limit
            code = {400: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 413: "RESOURCE_EXHAUSTED",
                    503: "UNAVAILABLE"}.get(e.status, "INTERNAL")
            raise
        except _Cut as e:
            code = str(e)
            raise asyncio.CancelledError() from None  # the connection is gone: nothing to send
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            self.metrics.requests.labels(code=code).inc()

    async def _speech(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise invalid("body", f"is not valid JSON ({e})") from None
        speech = speech_request.parse(body, self.info, self.config,
                                      request.headers.get("x-request-id", ""))
        req = speech.request
        request_id_var.set(req.request_id)
        try:
            handle = self.worker.submit(req, asyncio.get_running_loop())
        except Exception as e:  # noqa: BLE001 - Overloaded, ShuttingDown, EngineFailure
            raise from_exception(e) from None
        # (the request's INFO line is the one at its end, as over gRPC)
        log.debug("request %s (http): %d chars, voice=%s language=%s format=%s/%s", req.request_id,
                  len(req.text), req.voice, req.language, speech.format.name, speech.stream_format)
        try:
            return await _Stream(self, request, speech, handle, t0).run()
        finally:
            handle.cancel()


class _Stream:
    """One response: the events of a StreamHandle, encoded and written."""

    def __init__(self, handler: SpeechHandler, request, speech, handle, t0: float):
        self.handler, self.request, self.speech, self.handle, self.t0 = (
            handler, request, speech, handle, t0)
        self.rate = speech.request.output_sample_rate
        self.sse = speech.stream_format == "sse"
        self.response: web.StreamResponse | None = None
        self.num_chunks = 0

    def _headers(self) -> dict:
        fmt = self.speech.format
        return {"Content-Type": "text/event-stream" if self.sse else fmt.content_type,
                "x-sample-rate": str(self.rate), "x-request-id": self.speech.request.request_id,
                "Cache-Control": "no-cache"}

    async def run(self) -> web.StreamResponse:
        events = aiter(self.handle)
        first = await anext(events)
        if isinstance(first, StreamEnd) and first.finish_reason is FinishReason.ERROR:
            raise from_exception(first.error)
        encoder = AudioEncoder(self.speech.format, self.rate, whole=not self.speech.stream,
                               serial=self.speech.request.sampling.seed)
        try:
            if not self.speech.stream:
                return await self._whole(encoder, first, events)
            sock = self.request.transport.get_extra_info("socket") if self.request.transport else None
            if sock is not None:
                # a bounded kernel send buffer: a client that stops reading blocks our writes
                # within seconds of audio (HTTP/2 flow control does this for gRPC)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            self.response = web.StreamResponse(headers=self._headers())
            self.response.enable_chunked_encoding()
            await self.response.prepare(self.request)
            end = first
            if isinstance(first, AudioChunk):
                await self._send_chunk(encoder, first)
                async for end in events:
                    if isinstance(end, AudioChunk):
                        await self._send_chunk(encoder, end)
            if end.finish_reason is FinishReason.ERROR:
                await self._fail_midstream(end.error)
            await self._write(await self._encode(encoder.finish))
            if self.sse:
                await self._send(_sse({"type": "speech.audio.done", "usage": {
                    "input_tokens": 0, "output_tokens": end.num_frames,
                    "total_tokens": end.num_frames}}))
            await self.response.write_eof()
            self._log_done(end)
            return self.response
        finally:
            encoder.close()

    async def _whole(self, encoder: AudioEncoder, first, events) -> web.Response:
        """stream=false: the complete file in one body (WAV/FLAC headers carry the length)."""
        end = first
        if isinstance(first, AudioChunk):
            await self._consume(encoder, first)
            async for end in events:
                if isinstance(end, AudioChunk):
                    await self._consume(encoder, end)
        if end.finish_reason is FinishReason.ERROR:
            raise from_exception(end.error)
        data = await self._encode(encoder.finish)
        self._log_done(end)
        return web.Response(body=data, headers=self._headers())

    async def _consume(self, encoder: AudioEncoder, chunk: AudioChunk) -> None:
        await self._encode(encoder.encode, chunk.samples)
        self.handle.mark_sent(chunk.samples.shape[0])

    async def _encode(self, fn, *args) -> bytes:
        # compressed formats cost ~0.5 ms per 80 ms frame: off the event loop
        if self.speech.format.codec in (None, "pcm_mulaw", "pcm_alaw"):
            return fn(*args)
        return await asyncio.to_thread(fn, *args)

    async def _send_chunk(self, encoder: AudioEncoder, chunk: AudioChunk) -> None:
        await self._write(await self._encode(encoder.encode, chunk.samples))
        self.handle.mark_sent(chunk.samples.shape[0])
        if self.num_chunks == 0:
            self.handler.metrics.ttfc.observe(time.monotonic() - self.t0)
        self.num_chunks += 1

    async def _write(self, audio: bytes) -> None:
        """Encoded audio: the body itself, or a speech.audio.delta event."""
        if audio:
            await self._send(_sse({"type": "speech.audio.delta",
                                   "audio": base64.b64encode(audio).decode()})
                             if self.sse else audio)

    async def _send(self, data: bytes) -> None:
        stall = self.handler.config.stall_timeout_s
        try:
            await self.handler.stalls.run(self.response.write(data))
        except ConnectionError:  # the client hung up while this write waited
            raise _Cut("CANCELLED") from None
        except TimeoutError:
            log.warning("request %s: client read nothing for %.0f s; ending the stream",
                        self.speech.request.request_id, stall)
            self._abort()
            raise _Cut("RESOURCE_EXHAUSTED") from None

    async def _fail_midstream(self, error) -> None:
        err = from_exception(error)
        log.warning("request %s failed after %d chunks: %s", self.speech.request.request_id,
                    self.num_chunks, err.message)
        if self.sse:
            await self._send(_sse({"type": "error", **err.body()}))
        self._abort()
        raise _Cut({500: "INTERNAL", 503: "UNAVAILABLE"}.get(err.status, "RESOURCE_EXHAUSTED"))

    def _abort(self) -> None:
        """Close the connection without the final chunk: the client sees a cut body."""
        transport = self.request.transport
        if transport is not None:
            transport.abort()

    def _log_done(self, end: StreamEnd) -> None:
        audio_s = end.num_samples / self.rate
        wall_s = time.monotonic() - self.t0
        metrics = self.handler.metrics
        metrics.audio_seconds.inc(audio_s)
        if audio_s > 0:
            metrics.rtf.observe(wall_s / audio_s)
        req, speech = self.speech.request, self.speech
        log.info("request %s done (http): %s, %d chars, voice=%s language=%s format=%s/%s, %d frames, "
                 "%.2f s audio", req.request_id, end.finish_reason.value, len(req.text), req.voice,
                 req.language, speech.format.name, speech.stream_format, end.num_frames, audio_s,
                 extra={"finish_reason": end.finish_reason.value, "chars": len(req.text),
                        "voice": req.voice, "language": req.language, "frames": end.num_frames,
                        "audio_s": round(audio_s, 3), "chunks": self.num_chunks})


def _sse(event: dict) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
