"""Async client for TextToSpeechService over the generated grpc.aio stub."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc
import numpy as np

from .audio import chunk_samples
from .messages import set_sampling_and_reference
from .pb.tts.v1 import tts_pb2, tts_pb2_grpc
from .text_stream import TextStream


def build_request(text: str, *, voice: str = "", language: str = "", sample_rate_hz: int = 0,
                  encoding: int = tts_pb2.AUDIO_ENCODING_PCM_S16LE, seed: int | None = None,
                  greedy: bool = False, max_duration_s: float = 0.0, request_id: str = "",
                  reference_audio: bytes | None = None, reference_text: str = "",
                  **sampling) -> tts_pb2.SynthesizeRequest:
    """A SynthesizeRequest; `sampling` takes SamplingParams fields (temperature, top_k, ...)."""
    req = tts_pb2.SynthesizeRequest(text=text, voice=voice, language=language, encoding=encoding,
                                    sample_rate_hz=sample_rate_hz, max_duration_s=max_duration_s,
                                    request_id=request_id)
    set_sampling_and_reference(req, seed=seed, greedy=greedy, sampling=sampling,
                               reference_audio=reference_audio, reference_text=reference_text)
    return req


@dataclass
class SynthesisResult:
    """A whole utterance gathered from the stream, with client-side timings."""

    samples: np.ndarray
    sample_rate: int
    summary: tts_pb2.SynthesisSummary
    ttfc_s: float  # client-side: call start to the first audio bytes
    wall_s: float
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each chunk since start

    @property
    def audio_s(self) -> float:
        return self.samples.shape[0] / self.sample_rate if self.sample_rate else 0.0

    @property
    def rtf(self) -> float:
        return self.wall_s / self.audio_s if self.audio_s else float("inf")


class TTSClient:
    """`async with TTSClient("127.0.0.1:50051") as c: async for msg in c.stream(req): ...`

    channels: connections to open; calls take them in turn. A server with several RPC processes
    (`--rpc-processes`, four on a 16-core GPU host) gives each connection to one of them, so a
    client that runs many concurrent streams should open a few (one per few dozen streams):
    over one connection they all queue on one process."""

    def __init__(self, address: str, *, credentials: grpc.ChannelCredentials | None = None,
                 metadata: tuple[tuple[str, str], ...] = (), options=None, channels: int = 1):
        if channels < 1:
            raise ValueError(f"channels must be at least 1, got {channels}")
        self.address = address
        self.metadata = metadata
        options = list(options or ())
        if channels > 1 and not any(k == "grpc.use_local_subchannel_pool" for k, _ in options):
            # grpc shares one connection between channels of equal target and options otherwise
            options.append(("grpc.use_local_subchannel_pool", 1))
        self.channels = [grpc.aio.secure_channel(address, credentials, options=options) if credentials
                         else grpc.aio.insecure_channel(address, options=options) for _ in range(channels)]
        self.channel = self.channels[0]
        self._stubs = [tts_pb2_grpc.TextToSpeechServiceStub(c) for c in self.channels]
        self.stub = self._stubs[0]
        self._turn = itertools.cycle(self._stubs)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()

    def stream(self, request: tts_pb2.SynthesizeRequest, timeout: float | None = None):
        """The raw response stream (a grpc.aio call: iterate it, or `.cancel()` it)."""
        return next(self._turn).Synthesize(request, timeout=timeout, metadata=self.metadata)

    async def chunks(self, request, timeout: float | None = None) -> AsyncIterator[tts_pb2.SynthesizeResponse]:
        call = self.stream(request, timeout)
        try:
            async for msg in call:
                yield msg
        finally:
            call.cancel()

    async def synthesize(self, request, timeout: float | None = None) -> SynthesisResult:
        t0 = time.perf_counter()
        parts, times, rate, summary, ttfc = [], [], 0, None, 0.0
        async for msg in self.chunks(request, timeout):
            if msg.HasField("audio"):
                now = time.perf_counter() - t0
                if not parts:
                    ttfc = now
                times.append(now)
                rate = msg.audio.sample_rate_hz
                parts.append(chunk_samples(msg.audio))
            else:
                summary = msg.summary
        samples = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        return SynthesisResult(samples, rate or request.sample_rate_hz or 24000, summary, ttfc,
                               time.perf_counter() - t0, times)

    def text_stream(self, timeout: float | None = None) -> TextStream:
        """A StreamSynthesize call: contexts whose text is sent as it is produced."""
        return TextStream(next(self._turn), timeout=timeout, metadata=self.metadata)

    async def list_voices(self, timeout: float = 10.0) -> tts_pb2.ListVoicesResponse:
        return await self.stub.ListVoices(tts_pb2.ListVoicesRequest(), timeout=timeout,
                                          metadata=self.metadata)

    async def model_info(self, timeout: float = 10.0) -> tts_pb2.GetModelInfoResponse:
        return await self.stub.GetModelInfo(tts_pb2.GetModelInfoRequest(), timeout=timeout,
                                            metadata=self.metadata)
