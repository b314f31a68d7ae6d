"""The OpenAI-compatible HTTP API over a real loopback server (tiny synthetic model, torch
engine): the `openai` SDK streaming, every response format through a real decoder, SSE events,
/v1/models, the bad-input table, and Pipecat's OpenAITTSService in a real pipeline."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time

import httpx
import numpy as np
import openai
import pytest
import soundfile

from http_helpers import MODEL, SAMPLES_PER_FRAME, decode, pcm_samples, start_server, stop_servers, wait_idle

SPEECH = "/v1/audio/speech"
SAME = {"model": MODEL, "input": "Formats compare.", "voice": "ryan", "seed": 5,
        "max_duration_s": 1.6}  # 20 codec frames
FRAMES = 20


@pytest.fixture
async def served(tiny_custom):
    started = []
    base, address, app, server = await start_server(tiny_custom, started)
    yield base, app
    await stop_servers(started)


async def _post(base, body, **kwargs):
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        return await client.post(SPEECH, json=body, **kwargs)


async def _stream(base, body, worker):
    """(body bytes, headers, whether the stream was still synthesizing at the first bytes)."""
    data, live_at_first = bytearray(), None
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        async with client.stream("POST", SPEECH, json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for chunk in r.aiter_raw():
                if chunk and live_at_first is None:
                    live_at_first = worker.num_outstanding == 1
                data += chunk
    return bytes(data), r.headers, live_at_first


async def test_openai_sdk_streams_pcm_before_synthesis_ends(served):
    base, app = served
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="not-needed", max_retries=0)
    chunks, live = [], []
    async with client.audio.speech.with_streaming_response.create(
            model=MODEL, voice="ryan", input="Streaming through the SDK.", response_format="pcm",
            extra_body={"seed": 3, "max_duration_s": 2.4}) as response:
        assert response.headers["x-sample-rate"] == "24000"
        assert response.headers["content-type"] == "audio/pcm"
        assert response.headers["x-request-id"]
        async for chunk in response.iter_bytes():
            live.append(app.worker.num_outstanding)
            chunks.append(chunk)
    assert live[0] == 1  # the first bytes arrived while the server was still synthesizing
    assert sum(map(len, chunks)) == 30 * SAMPLES_PER_FRAME * 2
    await client.close()


async def test_openai_sdk_errors_carry_the_field(served):
    base, _ = served
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        await client.audio.speech.create(model=MODEL, voice="nobody", input="Hi.")
    assert e.value.status_code == 400 and e.value.param == "voice"
    assert 'unknown voice "nobody"' in e.value.message
    await client.close()


@pytest.mark.parametrize("fmt,rate,tolerance", [
    ("pcm", 24000, 0), ("wav", 24000, 0), ("flac", 24000, 0), ("mulaw", 8000, 0),
    ("alaw", 8000, 0), ("mp3", 24000, 2 * 1152), ("opus", 48000, 960), ("aac", 24000, 2048),
    ("pcm", 16000, 0), ("wav", 44100, 0), ("mp3", 16000, 2 * 1152), ("opus", 16000, 960),
    ("mulaw", 16000, 0),
])
async def test_every_format_streams_and_decodes(served, fmt, rate, tolerance):
    base, app = served
    body = SAME | {"response_format": fmt}
    if rate != {"mulaw": 8000, "alaw": 8000, "opus": 48000}.get(fmt, 24000):
        body["sample_rate"] = rate
    data, headers, live_at_first = await _stream(base, body, app.worker)
    assert live_at_first  # the first bytes (header included) left before synthesis ended
    assert headers["x-sample-rate"] == str(rate)
    samples, decoded_rate = decode(data, fmt, rate)
    played = 48000 if fmt == "opus" else rate  # Opus decodes at 48 kHz whatever went in
    assert decoded_rate == played
    expected = FRAMES * SAMPLES_PER_FRAME * played // 24000
    assert abs(samples.shape[0] - expected) <= tolerance, (samples.shape[0], expected)
    if fmt in ("wav", "flac", "mulaw", "alaw"):
        # the same request as 16-bit PCM at the same rate: lossless formats give it back exactly,
        # G.711 within its 8-bit companding error
        pcm = await _post(base, SAME | {"response_format": "pcm", "sample_rate": rate})
        reference = pcm_samples(pcm.content)
        error = np.abs(samples - reference).max()
        assert error <= (0 if fmt in ("wav", "flac") else 0.035), error


async def test_every_format_gives_the_same_bytes_for_the_same_request_and_seed(served):
    base, _ = served
    got = {}
    for fmt in ("pcm", "wav", "flac", "mulaw", "alaw", "mp3", "opus", "aac"):
        first, second = [(await _post(base, SAME | {"response_format": fmt})).content for _ in range(2)]
        assert first and first == second, fmt
        got[fmt] = first
    # an Ogg stream's serial number comes from the seed: another seed, another serial (chained
    # Ogg streams need distinct ones)
    other = (await _post(base, SAME | {"response_format": "opus", "seed": 6})).content
    assert got["opus"][14:18] == (5).to_bytes(4, "little") and other[14:18] == (6).to_bytes(4, "little")


async def test_whole_file_when_not_streamed(served):
    base, _ = served
    r = await _post(base, SAME | {"response_format": "wav", "stream": False})
    assert r.status_code == 200 and int(r.headers["content-length"]) == len(r.content)
    info = soundfile.info(io.BytesIO(r.content))  # the header carries the real length
    assert info.frames == FRAMES * SAMPLES_PER_FRAME and info.samplerate == 24000


async def test_sse_events_carry_the_same_audio(served):
    base, _ = served
    r = await _post(base, SAME | {"response_format": "pcm", "stream_format": "sse"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in r.text.split("\n\n") if b.strip()]
    events = [json.loads(b.removeprefix("data: ")) for b in blocks]
    assert all(b.startswith("data: ") for b in blocks)
    assert {e["type"] for e in events[:-1]} == {"speech.audio.delta"}
    assert events[-1]["type"] == "speech.audio.done"
    assert events[-1]["usage"]["output_tokens"] == FRAMES
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    plain = await _post(base, SAME | {"response_format": "pcm"})
    assert len(events) > 2 and audio == plain.content


async def test_models_health_ready(served):
    base, _ = served
    async with httpx.AsyncClient(base_url=base) as client:
        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
        assert (await client.get("/health")).status_code == 200
        ready = await client.get("/ready")
        assert ready.status_code == 200 and ready.json()["status"] == "ready"
        missing = await client.get("/v1/nothing")
        assert missing.status_code == 404 and "error" in missing.json()


def _wav_b64(seconds=1.0):
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(int(seconds * 24000), np.float32), 24000, format="WAV")
    return base64.b64encode(buf.getvalue()).decode()


BAD = [
    ({"model": MODEL}, "input"),
    (SAME | {"input": "   "}, "input"),
    (SAME | {"input": 42}, "input"),
    (SAME | {"input": "x" * 2001}, "input"),
    (SAME | {"input": "bell \x07"}, "input"),
    (SAME | {"model": "tts-1"}, "model"),
    (SAME | {"voice": "nobody"}, "voice"),
    (SAME | {"response_format": "ogg"}, "response_format"),
    (SAME | {"speed": 1.5}, "speed"),
    (SAME | {"instructions": "Speak softly."}, "instructions"),
    (SAME | {"stream_format": "chunks"}, "stream_format"),
    (SAME | {"stream_format": "sse", "stream": False}, "stream"),
    (SAME | {"stream": "yes"}, "stream"),
    (SAME | {"sample_rate": 4000}, "sample_rate"),
    (SAME | {"sample_rate": 22050, "response_format": "opus"}, "sample_rate"),
    (SAME | {"language": "klingon"}, "language"),
    (SAME | {"seed": -1}, "seed"),
    (SAME | {"max_duration_s": 1e9}, "max_duration_s"),
    (SAME | {"temperature": 0}, "temperature"),
    (SAME | {"top_p": 2.0}, "top_p"),
    (SAME | {"ref_audio": _wav_b64()}, "ref_audio"),  # a CustomVoice model does not clone
    (SAME | {"ref_audio": "not base64!"}, "ref_audio"),
    (SAME | {"ref_text": "words"}, "ref_text"),
    (SAME | {"non_streaming_mode": 1}, "non_streaming_mode"),
    (SAME | {"speaker": "ryan"}, "speaker"),
    ([1, 2], "body"),
]


async def test_bad_input_is_400_naming_the_field(served):
    base, app = served
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        for body, param in BAD:
            r = await client.post(SPEECH, json=body)
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == param and error["message"].startswith(f"{param}: "), error
            assert error["type"] == "invalid_request_error"
        r = await client.post(SPEECH, content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "body"
        r = await client.post(SPEECH, json=SAME, headers={"x-request-id": "no spaces allowed"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-id"
        # and it keeps serving, with the client's request id echoed
        r = await client.post(SPEECH, json=SAME | {"response_format": "pcm"},
                              headers={"x-request-id": "mine-1"})
        assert r.status_code == 200 and len(r.content) == FRAMES * SAMPLES_PER_FRAME * 2
        assert r.headers["x-request-id"] == "mine-1"
    assert await wait_idle(app.worker) < 10


async def test_openai_voice_names_take_the_default_voice(served):
    base, _ = served
    alloy = await _post(base, SAME | {"voice": "alloy", "response_format": "pcm"})
    default = await _post(base, SAME | {"voice": "", "response_format": "pcm"})
    assert alloy.status_code == 200 and alloy.content == default.content


async def test_pipecat_openai_tts_service_speaks(served):
    from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame, TTSSpeakFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams
    from pipecat.services.openai.tts import OpenAITTSService
    from pipecat.tests.utils import run_test

    base, app = served
    tts = OpenAITTSService(api_key="not-needed", base_url=f"{base}/v1",
                           settings=OpenAITTSService.Settings(model=MODEL, voice="alloy"))
    t0 = time.monotonic()
    down, up = await run_test(Pipeline([tts]), frames_to_send=[TTSSpeakFrame("Hello there.")],
                              pipeline_params=PipelineParams(audio_out_sample_rate=24000))
    audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
    assert not [f for f in up if isinstance(f, ErrorFrame)]
    assert audio and {(f.sample_rate, f.num_channels) for f in audio} == {(24000, 1)}
    # the runaway guard for 12 characters: 2 s + 0.1 s each = 3.2 s = 40 frames at most
    total = sum(len(f.audio) for f in audio)
    assert 0 < total <= 40 * SAMPLES_PER_FRAME * 2 and total % 2 == 0
    assert await wait_idle(app.worker) < 10 and time.monotonic() - t0 < 120


async def test_non_streaming_mode_switches_the_text_mode(served):
    base, _ = served
    default = await _post(base, SAME | {"response_format": "pcm"})
    explicit = await _post(base, SAME | {"response_format": "pcm", "non_streaming_mode": True})
    streamed = await _post(base, SAME | {"response_format": "pcm", "non_streaming_mode": False})
    # CustomVoice's default is qwen-tts's: the whole text in the prompt
    assert default.content == explicit.content != streamed.content
    assert len(streamed.content) == len(default.content) == FRAMES * SAMPLES_PER_FRAME * 2


async def test_base_model_clones_from_ref_audio(tiny_base, reference_audio):
    started = []
    base, _, _, _ = await start_server(tiny_base, started, name="synthetic-tiny-base")
    wav, rate = reference_audio
    buf = io.BytesIO()
    soundfile.write(buf, wav, rate, format="WAV")
    ref = base64.b64encode(buf.getvalue()).decode()
    body = {"model": "synthetic-tiny-base", "input": "Clone me.", "response_format": "pcm",
            "seed": 2, "max_duration_s": 0.8}
    try:
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            x_vector = await client.post(SPEECH, json=body | {"ref_audio": ref, "voice": "alloy"})
            in_context = await client.post(SPEECH, json=body | {
                "ref_audio": f"data:audio/wav;base64,{ref}", "ref_text": "Some reference words."})
            missing = await client.post(SPEECH, json=body)
    finally:
        await stop_servers(started)
    assert x_vector.status_code == in_context.status_code == 200, in_context.text
    assert len(x_vector.content) == len(in_context.content) == 10 * SAMPLES_PER_FRAME * 2
    assert x_vector.content != in_context.content  # the transcript joins the prompt
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "ref_audio"
