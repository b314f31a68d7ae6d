"""TextToSpeechService: validates, submits to the engine worker, streams chunks back.

No model work happens here; a stream's synthesis stops as soon as its handler exits
(client cancel, deadline, disconnect or shutdown all raise CancelledError at an await).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from tts_client.pb.tts.v1 import tts_pb2, tts_pb2_grpc

from .. import __version__, aio
from ..api import (AudioChunk, EngineFailure, FinishReason, InvalidRequest, ModelInfo, Overloaded,
                   ShuttingDown)
from ..config import ServerConfig
from ..logs import request_id_var
from . import convert, stream_session
from .stream_session import WRITE_FAILED, Abort, error_of

log = logging.getLogger(__name__)


def _deadline_passed(context) -> bool:
    """A call that ended at its deadline (the client's copy fires a moment before the server's)
    rather than by a client cancel or hang-up."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0.1


class TextToSpeechServicer(tts_pb2_grpc.TextToSpeechServiceServicer):
    def __init__(self, worker, info: ModelInfo, config: ServerConfig):
        self.worker = worker
        self.info = info
        self.config = config
        self.metrics = worker.metrics
        self.draining = False  # set by TTSServer.stop: new calls get UNAVAILABLE
        self.num_in_flight = 0  # Synthesize calls being handled (drain waits for them)
        self.playback_ends_at = 0.0  # monotonic: when real-time players have every finished stream
        self.stalls = aio.StallWatch(config.stall_timeout_s)  # every call's writes (StreamSynthesize's too)

    async def Synthesize(self, request, context):
        """Counts every call's final status code in tts_requests_total; every call that ends
        with an error logs its request id and reason and returns `x-request-id` as well."""
        code = "OK"
        request_id = convert.request_id_of(request)
        request_id_var.set(request_id)
        self.num_in_flight += 1
        try:
            if self.draining:
                raise Abort(grpc.StatusCode.UNAVAILABLE,
                             "server is draining (shutting down); retry on another replica")
            await self._synthesize(request, context, request_id)
        except Abort as e:
            code = e.code.name
            log.info("request %s ended with %s: %s", request_id, code, e.details,
                     extra={"code": code, "request_id": request_id})
            context.set_trailing_metadata((("x-request-id", request_id),))
            await context.abort(e.code, e.details)
        except asyncio.CancelledError:
            code = "DEADLINE_EXCEEDED" if _deadline_passed(context) else "CANCELLED"
            raise
        except Exception:
            code = "INTERNAL"
            log.exception("Synthesize failed")
            raise
        finally:
            self.num_in_flight -= 1
            self.metrics.requests.labels(code=code).inc()

    async def _synthesize(self, request, context, request_id: str):
        t0 = time.monotonic()
        if isinstance(request, convert.MalformedRequest):
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{request.field}: {request.message}")
        try:
            req = convert.to_request(request, self.info, self.config, request_id)
            handle = self.worker.submit(req, asyncio.get_running_loop())
        except (InvalidRequest, Overloaded, ShuttingDown, EngineFailure) as e:
            raise Abort(*error_of(e, "synthesis")) from None
        try:
            await self._stream(req, handle, request, context, t0)
        finally:
            handle.cancel()

    async def _stream(self, req, handle, request, context, t0):
        # the headers (with the id) go out now, a batch of their own, so that they are in by the
        # first chunk: with the id in the trailers instead, a one-connection burst's intake was
        # ~17% faster on a 2-core machine but one stream's first audio 0.2 ms later at the client
        # on a 16-core GPU host (3 of 3 rounds), where the bursts did not move (session 36)
        await context.send_initial_metadata((("x-request-id", req.request_id),))
        encoding = convert.encoding_of(request)
        rate = req.output_sample_rate
        # what the request asked goes into its one INFO line, at the end: a line per call at the
        # start cost ~50 us of event-loop time per call in a burst (BENCHMARKS.md, session 30)
        log.debug("request %s: %d chars, voice=%s language=%s max_frames=%d%s", req.request_id,
                  len(req.text), req.voice, req.language, req.max_frames,
                  " +reference" if req.reference is not None else "")
        ttfc_ms, num_chunks, first_audio = 0.0, 0, None
        stall = self.config.stall_timeout_s

        async def write(message):
            # A client that stops reading blocks this write (HTTP/2 flow control); its stream
            # pauses in the engine once max_buffer_s of audio waits, and ends after `stall`.
            try:
                await self.stalls.run(context.write(message))
            except WRITE_FAILED as e:
                # the client hung up (or its deadline passed) while this write was in flight:
                # the same as the CancelledError that would otherwise reach us at the next await
                log.debug("write failed (client gone: %s): %r", context.cancelled(), e)
                raise asyncio.CancelledError() from None
            except TimeoutError:
                log.warning("request %s: client read nothing for %.0f s; ending the stream",
                            req.request_id, stall)
                raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"client read no audio for {stall:g} s; stream ended "
                             f"({handle.backlog_s():.1f} s of audio unsent)") from None

        encoder = convert.encoder_for(encoding, rate, req.sampling.seed)  # G.711 / Opus; None: PCM

        async def encode(fn, *args):
            # Opus costs ~0.4 ms per 80 ms frame: off the event loop; G.711 is a table lookup
            if encoding == tts_pb2.AUDIO_ENCODING_OGG_OPUS:
                return await asyncio.to_thread(fn, *args)
            return fn(*args)

        try:
            async for event in handle:
                if isinstance(event, AudioChunk):
                    data = await encode(encoder.encode, event.samples) if encoder else None
                    await write(convert.chunk_message(event, rate, encoding, data))
                    handle.mark_sent(event.samples.shape[0])
                    if num_chunks == 0:
                        now = time.monotonic()
                        ttfc_ms = (now - t0) * 1000.0
                        self.metrics.ttfc.observe(ttfc_ms / 1000.0)
                        first_audio = event.timings
                        if first_audio is not None and "ready_at" in first_audio:
                            first_audio = {k: v for k, v in first_audio.items() if k != "ready_at"}
                            first_audio["write_ms"] = (now - event.timings["ready_at"]) * 1000.0
                    num_chunks += 1
                    continue
                end = event
            if end.finish_reason is FinishReason.ERROR:
                raise Abort(*error_of(end.error, "synthesis"))
            tail = await encode(encoder.finish) if encoder else b""
            if tail:  # what the encoder held back (Opus: the final Ogg page), no new samples
                await write(tts_pb2.SynthesizeResponse(audio=tts_pb2.AudioChunk(
                    audio=tail, sample_rate_hz=rate, encoding=encoding,
                    sequence_number=num_chunks, sample_offset=end.num_samples)))
            wall_ms = (time.monotonic() - t0) * 1000.0
            summary = convert.summary_message(end, req.request_id, rate, ttfc_ms, wall_ms, num_chunks,
                                              first_audio)
            s = summary.summary
            self.metrics.audio_seconds.inc(s.audio_seconds)
            if s.audio_seconds > 0:
                self.metrics.rtf.observe(s.real_time_factor)
            await write(summary)
            # a client playing from its first chunk in real time has the last audio by then
            self.playback_ends_at = max(self.playback_ends_at,
                                        t0 + ttfc_ms / 1000.0 + s.audio_seconds)
            log.info("request %s done: %s, %d chars, voice=%s language=%s%s, %d frames, %.2f s audio, "
                     "ttfc %.1f ms, rtf %.3f", req.request_id, end.finish_reason.value, len(req.text),
                     req.voice, req.language, " +reference" if req.reference is not None else "",
                     s.num_frames, s.audio_seconds, ttfc_ms, s.real_time_factor,
                     extra={"finish_reason": end.finish_reason.value, "chars": len(req.text),
                            "voice": req.voice, "language": req.language, "max_frames": req.max_frames,
                            "frames": s.num_frames, "audio_s": round(s.audio_seconds, 3),
                            "ttfc_ms": round(ttfc_ms, 1), "rtf": round(s.real_time_factor, 4),
                            "chunks": num_chunks})
        except asyncio.CancelledError:
            if _deadline_passed(context):
                log.info("request %s: the client's deadline passed after %d chunks; stopped",
                         req.request_id, num_chunks, extra={"chunks": num_chunks, "code":
                                                            "DEADLINE_EXCEEDED"})
            else:
                log.info("request %s cancelled by the client after %d chunks", req.request_id,
                         num_chunks, extra={"chunks": num_chunks, "code": "CANCELLED"})
            raise
        finally:
            if encoder is not None:
                encoder.close()

    async def StreamSynthesize(self, request_iterator, context):
        """Incremental text in (contexts fed by an LLM's token stream), audio out."""
        try:
            await stream_session.StreamSession(self, context).run(request_iterator)
        except stream_session.Abort as e:
            self.metrics.requests.labels(code=e.code.name).inc()
            await context.abort(e.code, e.details)

    async def ListVoices(self, request, context):
        info = self.info
        voices = [tts_pb2.Voice(name=v, languages=list(info.voice_languages.get(v, ())),
                                is_default=(v == info.default_voice)) for v in info.voices]
        return tts_pb2.ListVoicesResponse(voices=voices, languages=list(info.languages),
                                          requires_reference=info.requires_reference)

    async def GetModelInfo(self, request, context):
        info, cfg = self.info, self.config
        return tts_pb2.GetModelInfoResponse(
            model=info.name, model_type=info.model_type, model_size=info.model_size,
            is_synthetic=info.is_synthetic, warning=info.warning, engine=info.engine,
            device=info.device, dtype=info.dtype, native_sample_rate_hz=info.sample_rate,
            frame_rate_hz=info.frame_rate, max_text_chars=cfg.max_text_chars,
            max_concurrent_streams=self.worker.max_streams, max_duration_s=cfg.max_duration_s,
            server_version=__version__)
