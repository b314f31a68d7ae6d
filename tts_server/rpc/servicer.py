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

from .. import __version__
from ..api import AudioChunk, FinishReason, InvalidRequest, ModelInfo, Overloaded, ShuttingDown
from ..config import ServerConfig
from . import convert

log = logging.getLogger(__name__)


class TextToSpeechServicer(tts_pb2_grpc.TextToSpeechServiceServicer):
    def __init__(self, worker, info: ModelInfo, config: ServerConfig):
        self.worker = worker
        self.info = info
        self.config = config

    async def Synthesize(self, request, context):
        t0 = time.monotonic()
        try:
            req = convert.to_request(request, self.info, self.config)
            handle = self.worker.submit(req, asyncio.get_running_loop())
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Overloaded as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ShuttingDown as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        await context.send_initial_metadata((("x-request-id", req.request_id),))
        encoding = convert.encoding_of(request)
        rate = req.output_sample_rate
        log.info("request %s: %d chars, voice=%s language=%s max_frames=%d", req.request_id,
                 len(req.text), req.voice, req.language, req.max_frames)
        ttfc_ms, num_chunks = 0.0, 0
        try:
            async for event in handle:
                if isinstance(event, AudioChunk):
                    await context.write(convert.chunk_message(event, rate, encoding))
                    if num_chunks == 0:
                        ttfc_ms = (time.monotonic() - t0) * 1000.0
                    num_chunks += 1
                    continue
                end = event
            if end.finish_reason is FinishReason.ERROR:
                if isinstance(end.error, InvalidRequest):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(end.error))
                log.error("request %s failed: %r", req.request_id, end.error)
                await context.abort(grpc.StatusCode.INTERNAL, f"synthesis failed: {end.error}")
            wall_ms = (time.monotonic() - t0) * 1000.0
            summary = convert.summary_message(end, req.request_id, rate, ttfc_ms, wall_ms, num_chunks)
            await context.write(summary)
            s = summary.summary
            log.info("request %s done: %s, %d frames, %.2f s audio, ttfc %.1f ms, rtf %.3f",
                     req.request_id, end.finish_reason.value, s.num_frames, s.audio_seconds,
                     ttfc_ms, s.real_time_factor)
        except asyncio.CancelledError:
            log.info("request %s cancelled by the client after %d chunks", req.request_id, num_chunks)
            raise
        finally:
            handle.cancel()

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
