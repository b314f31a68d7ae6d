"""The telephony encodings on gRPC (G.711 mu-law/A-law, Ogg Opus), the same encoders as the HTTP
API's formats, over the loopback server with the tiny model; decoded with real decoders."""

from __future__ import annotations

import io

import av
import grpc
import numpy as np
import pytest

from tts_client.client import TTSClient, build_request
from tts_client.pb.tts.v1 import tts_pb2

SHORT = dict(max_duration_s=0.8, seed=7)  # 10 frames


async def _chunks(address, request):
    async with TTSClient(address) as client:
        return [m async for m in client.chunks(request, timeout=60)]


@pytest.mark.parametrize("encoding", [tts_pb2.AUDIO_ENCODING_MULAW, tts_pb2.AUDIO_ENCODING_ALAW])
async def test_g711_at_8khz_matches_pcm_within_companding_error(tiny_server, encoding):
    async with TTSClient(tiny_server) as client:
        g711 = await client.synthesize(build_request("Telephony.", encoding=encoding, **SHORT),
                                       timeout=60)
        pcm = await client.synthesize(build_request("Telephony.", sample_rate_hz=8000, **SHORT),
                                      timeout=60)
    assert g711.sample_rate == 8000  # the telephony default, unasked
    assert g711.samples.shape == pcm.samples.shape == (10 * 640,)
    assert np.abs(g711.samples - pcm.samples).max() <= 0.035
    msgs = await _chunks(tiny_server, build_request("Telephony.", encoding=encoding, **SHORT))
    audio = [m.audio for m in msgs if m.HasField("audio")]
    assert {a.encoding for a in audio} == {encoding}
    assert all(len(a.audio) == a.num_samples for a in audio)  # one byte per sample


async def test_ogg_opus_chunks_form_one_file(tiny_server):
    request = build_request("Opus, please.", encoding=tts_pb2.AUDIO_ENCODING_OGG_OPUS,
                            sample_rate_hz=24000, **SHORT)
    msgs = await _chunks(tiny_server, request)
    audio = [m.audio for m in msgs if m.HasField("audio")]
    assert msgs[-1].HasField("summary") and audio[0].audio.startswith(b"OggS")
    # the same request and seed, the same bytes: the Ogg stream's serial number is the seed's
    # (FFmpeg's muxer picks a random one unless asked)
    again = await _chunks(tiny_server, request)
    assert b"".join(m.audio.audio for m in again if m.HasField("audio")) == b"".join(a.audio for a in audio)
    assert int.from_bytes(audio[0].audio[14:18], "little") == SHORT["seed"]
    assert audio[0].num_samples > 0 and len(audio[0].audio) > 0  # the header with the first audio
    assert sum(a.num_samples for a in audio) == 10 * 1920
    with av.open(io.BytesIO(b"".join(a.audio for a in audio))) as container:
        stream = container.streams.audio[0]
        decoded = sum(f.samples for f in container.decode(stream))
        assert stream.rate == 48000
    assert abs(decoded - 10 * 1920 * 2) <= 960


async def test_opus_rate_outside_its_set_is_invalid(tiny_server):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _chunks(tiny_server, build_request("x", encoding=tts_pb2.AUDIO_ENCODING_OGG_OPUS,
                                                 sample_rate_hz=22050))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("sample_rate_hz: opus takes")


async def test_stream_synthesize_contexts_speak_g711_and_refuse_opus(tiny_server):
    async def speak(encoding, sample_rate_hz=0):
        async with TTSClient(tiny_server) as client:
            call = client.text_stream(timeout=120)
            await call.open("c", voice="ryan", language="english", greedy=True, seed=3,
                            max_duration_s=0.8, encoding=encoding, sample_rate_hz=sample_rate_hz)
            await call.text("c", "Telephony, streamed in.")
            await call.end("c")
            result = (await call.collect({"c"}))["c"]
            await call.close()
            return result

    mulaw = await speak(tts_pb2.AUDIO_ENCODING_MULAW)
    pcm = await speak(tts_pb2.AUDIO_ENCODING_PCM_S16LE, 8000)
    assert mulaw.done.error_code == 0 and mulaw.sample_rate == 8000
    assert mulaw.audio.shape == pcm.audio.shape and mulaw.audio.shape[0] == mulaw.done.num_frames * 640
    assert np.abs(mulaw.audio - pcm.audio).max() <= 0.035
    opus = await speak(tts_pb2.AUDIO_ENCODING_OGG_OPUS)
    assert opus.done.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert opus.done.error_message.startswith("config.encoding: OGG_OPUS")
