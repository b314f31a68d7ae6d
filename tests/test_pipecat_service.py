"""QwenTTSService in real Pipecat pipelines against a loopback server on the tiny synthetic model:
streaming, LLM turns, interruption, errors, retries, settings and metrics."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from pipecat.frames.frames import (ErrorFrame, Frame, InterruptionFrame, LLMFullResponseEndFrame,
                                   LLMFullResponseStartFrame, LLMTextFrame, MetricsFrame,
                                   TTSAudioRawFrame, TTSSpeakFrame, TTSStartedFrame,
                                   TTSStoppedFrame, TTSTextFrame, TTSUpdateSettingsFrame)
from pipecat.metrics.metrics import ProcessingMetricsData, TTFBMetricsData, TTSUsageMetricsData
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.tests.utils import run_test
from pipecat.utils.errors import ErrorCategory
from pipecat.workers.runner import WorkerRunner

from pipecat_service import QwenTTSService, QwenTTSSettings
from pipecat_service.agent import AgentConfig, AgentSetupError, check_tts_server
from tts_client.bench import free_port

RATE = 16000  # the pipeline's output rate; the server resamples to it
FRAME_BYTES = 1280 * 2  # one 80 ms codec frame of 16-bit PCM at RATE


class FrameRecorder(FrameProcessor):
    """Passes frames on, noting when each went downstream and how many streams the server had."""

    def __init__(self, worker):
        super().__init__()
        self.server_worker = worker
        self.events: list[tuple[float, Frame, int]] = []  # (time.time(), frame, num_outstanding)
        self._seen = asyncio.Event()

    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        if direction == FrameDirection.DOWNSTREAM:
            self.events.append((time.time(), frame, self.server_worker.num_outstanding))
            self._seen.set()
        await self.push_frame(frame, direction)

    def of(self, kind) -> list:
        return [f for _, f, _ in self.events if isinstance(f, kind)]

    async def wait_for(self, kind, timeout=20.0):
        async with asyncio.timeout(timeout):
            while not self.of(kind):
                self._seen.clear()
                await self._seen.wait()


def make_tts(address, service_kwargs=None, **settings) -> QwenTTSService:
    """Deterministic, short utterances (10 codec frames) unless the settings say otherwise."""
    kwargs = dict(stop_frame_timeout_s=1.0, retry_backoff_s=0.05) | (service_kwargs or {})
    return QwenTTSService(address=address, **kwargs,
                          settings=QwenTTSSettings(**(dict(seed=7, max_duration_s=0.8) | settings)))


async def speak(tts, server_app, frames, metrics=False):
    """run_test on [tts, recorder]: (frames down, frames up, recorder)."""
    rec = FrameRecorder(server_app.worker)
    params = PipelineParams(audio_out_sample_rate=RATE, enable_metrics=metrics,
                            enable_usage_metrics=metrics)
    down, up = await run_test(Pipeline([tts, rec]), frames_to_send=frames, pipeline_params=params)
    return down, up, rec


def audio_bytes(recorder, start=0) -> int:
    return sum(len(f.audio) for f in recorder.of(TTSAudioRawFrame)[start:])


def errors(up, text="") -> list[ErrorFrame]:
    return [f for f in up if isinstance(f, ErrorFrame) and text in f.error]


def collapse(frames) -> list[str]:
    """Frame type names, with each run of audio frames shown once."""
    names = [type(f).__name__ for f in frames]
    return [n for i, n in enumerate(names) if n != "TTSAudioRawFrame" or names[i - 1] != n]


def server_lines(caplog, text):
    return [r for r in caplog.records if r.name.startswith("tts_server") and text in r.getMessage()]


async def wait_idle(worker, timeout=5.0):
    deadline = time.monotonic() + timeout
    while worker.num_outstanding and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return worker.num_outstanding


@pytest.fixture(autouse=True)
def server_logs(caplog):
    caplog.set_level(logging.INFO, logger="tts_server")


async def test_sentence_streams_audio_while_the_server_decodes(tiny_server, tiny_app, caplog):
    tts = make_tts(tiny_server, max_duration_s=2.4)  # 30 codec frames
    down, up, rec = await speak(tts, tiny_app, [TTSSpeakFrame("Streaming is the point.")])
    # Streaming, seen from the server: the first audio frame went by while the server was
    # still synthesizing the stream, well before it logged the utterance as done.
    t_first, _, outstanding = next(e for e in rec.events if isinstance(e[1], TTSAudioRawFrame))
    (done,) = server_lines(caplog, " done: ")
    assert outstanding == 1
    assert done.created - t_first > 0.3
    audio = rec.of(TTSAudioRawFrame)
    assert len(audio) >= 2 and not errors(up)
    assert collapse(down) == ["AggregatedTextFrame", "TTSStartedFrame", "TTSAudioRawFrame",
                              "TTSTextFrame", "LLMAssistantPushAggregationFrame", "TTSStoppedFrame"]
    assert {(f.sample_rate, f.num_channels) for f in audio} == {(RATE, 1)}
    assert audio_bytes(rec) == 30 * FRAME_BYTES  # resampled by the server
    assert [f.text for f in rec.of(TTSTextFrame)] == ["Streaming is the point."]


async def test_llm_text_stream_speaks_two_sentences_in_one_turn(tiny_server, tiny_app, caplog):
    tokens = ["Hello ", "there", ". How", " are you", " today?"]
    frames = [LLMFullResponseStartFrame(), *[LLMTextFrame(t) for t in tokens],
              LLMFullResponseEndFrame()]
    down, up, rec = await speak(make_tts(tiny_server), tiny_app, frames)
    sentence = ["AggregatedTextFrame", "TTSAudioRawFrame", "TTSTextFrame"]  # one started/stopped
    assert collapse(down) == ["LLMFullResponseStartFrame", sentence[0], "TTSStartedFrame",
                              *sentence[1:], *sentence, "TTSStoppedFrame",
                              "LLMFullResponseEndFrame"]
    assert [f.text.strip() for f in rec.of(TTSTextFrame)] == ["Hello there.", "How are you today?"]
    assert audio_bytes(rec) == 2 * 10 * FRAME_BYTES and not errors(up)
    assert len(server_lines(caplog, " done: ")) == 2  # one Synthesize call per sentence


async def test_interruption_cancels_the_server_stream(tiny_server, tiny_app, caplog):
    rec = FrameRecorder(tiny_app.worker)
    tts = make_tts(tiny_server, max_duration_s=60.0)
    worker = PipelineWorker(Pipeline([tts, rec]), params=PipelineParams(audio_out_sample_rate=RATE),
                            idle_timeout_secs=None, enable_rtvi=False)
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    run = asyncio.create_task(runner.run())
    try:
        await worker.queue_frame(TTSSpeakFrame("A very long answer that the user talks over."))
        await rec.wait_for(TTSAudioRawFrame)
        assert tiny_app.worker.num_outstanding == 1
        (started,) = rec.of(TTSStartedFrame)
        await worker.queue_frame(InterruptionFrame())
        assert await wait_idle(tiny_app.worker) == 0
        num_audio = len(rec.of(TTSAudioRawFrame))
        short = QwenTTSSettings(max_duration_s=0.8)
        await worker.queue_frames([TTSUpdateSettingsFrame(delta=short),
                                   TTSSpeakFrame("Sure, go ahead.")])
        await rec.wait_for(TTSStoppedFrame)
    finally:
        await worker.stop_when_done()
        await asyncio.wait_for(run, 20)
    request_id = f"{started.context_id[:8]}.1"
    assert server_lines(caplog, f"request {request_id} cancelled by the client after")
    assert server_lines(caplog, f"request {request_id}: synthesis stopped after")
    assert not server_lines(caplog, f"request {request_id} done")
    # No stop frame for the interrupted context; the next sentence plays in full.
    (stopped,) = rec.of(TTSStoppedFrame)
    assert stopped.context_id != started.context_id
    assert audio_bytes(rec, num_audio) == 10 * FRAME_BYTES


async def test_rejected_sentence_is_not_fatal_and_the_next_one_speaks(tiny_server, tiny_app):
    tts = make_tts(tiny_server)
    frames = [TTSSpeakFrame("x" * 2001), TTSSpeakFrame("Next sentence.")]  # limit: 2000 chars
    down, up, rec = await speak(tts, tiny_app, frames)
    assert len(errors(up)) == 1, [e.error for e in errors(up)]
    (err,) = errors(up)  # one ErrorFrame: not a second "completed with no audio" one from Pipecat
    assert "INVALID_ARGUMENT" in err.error
    assert not err.fatal and err.category is ErrorCategory.APPLICATION and "text" in err.error
    assert tts.is_usable and audio_bytes(rec) == 10 * FRAME_BYTES
    assert [f.text for f in rec.of(TTSTextFrame)][-1] == "Next sentence."


async def test_bad_voice_writes_the_service_off_until_settings_change(tiny_server, tiny_app):
    tts = make_tts(tiny_server, voice="nobody")
    frames = [TTSSpeakFrame("Who am I?"), TTSSpeakFrame("Not spoken."),
              TTSUpdateSettingsFrame(delta=QwenTTSSettings(voice="ryan")),
              TTSSpeakFrame("Ryan speaking.")]
    down, up, rec = await speak(tts, tiny_app, frames)
    assert len(errors(up)) == 1, [e.error for e in errors(up)]
    (err,) = errors(up)  # "Not spoken." was not even sent; no "completed with no audio" either
    assert "INVALID_ARGUMENT" in err.error
    assert err.category is ErrorCategory.INVALID_REQUEST and "voice" in err.error
    assert tts.is_usable  # the settings update made it usable again
    assert [f.text for f in rec.of(TTSTextFrame)][-1] == "Ryan speaking."
    assert audio_bytes(rec) == 10 * FRAME_BYTES


async def test_server_down_gives_error_frames_after_retries(tiny_app):
    tts = make_tts(f"127.0.0.1:{free_port()}", dict(stop_frame_timeout_s=0.3))
    attempts = []

    @tts.event_handler("on_connection_error")
    async def on_connection_error(service, error):
        attempts.append(error)

    sentences = [TTSSpeakFrame(f"Is anybody there? Try {i}.") for i in range(4)]
    down, up, rec = await speak(tts, tiny_app, sentences)
    unavailable = errors(up, "UNAVAILABLE")
    assert len(unavailable) == 4 and len(attempts) == 4 * 2  # two retries each
    assert len(errors(up)) == 4  # one ErrorFrame per sentence
    assert {(e.category, e.fatal) for e in unavailable} == {(ErrorCategory.CONNECTIVITY, False)}
    assert tts.is_usable and not rec.of(TTSAudioRawFrame)  # an outage does not write it off


async def test_unavailable_is_retried_until_the_server_is_back(tiny_app):
    from tts_server.config import ServerConfig
    from tts_server.rpc.server import TTSServer

    port = free_port()
    tts = make_tts(f"127.0.0.1:{port}")
    servers = []

    @tts.event_handler("on_connection_error")
    async def start_server(service, error):
        if not servers:
            servers.append(TTSServer(tiny_app.worker, tiny_app.info,
                                     ServerConfig(port=port), owns_worker=False))
            await servers[0].start()

    try:
        down, up, rec = await speak(tts, tiny_app, [TTSSpeakFrame("Back online.")])
    finally:
        for server in servers:
            await server.stop(grace=1.0)
    assert servers and not errors(up) and audio_bytes(rec) == 10 * FRAME_BYTES


async def test_metrics_frames_when_enabled(tiny_server, tiny_app):
    text = "Measure me."
    down, _, _ = await speak(make_tts(tiny_server), tiny_app, [TTSSpeakFrame(text)], metrics=True)
    data = [d for f in down if isinstance(f, MetricsFrame) for d in f.data]
    ttfb = [d.value for d in data if isinstance(d, TTFBMetricsData) and d.value > 0]
    assert len(ttfb) == 1 and ttfb[0] < 10  # zeros come first, announcing the processor
    assert [d.value for d in data if isinstance(d, TTSUsageMetricsData)] == [len(text)]
    assert [d for d in data if isinstance(d, ProcessingMetricsData)]
    down, _, _ = await speak(make_tts(tiny_server), tiny_app, [TTSSpeakFrame(text)])
    assert not [f for f in down if isinstance(f, MetricsFrame)]


class MetadataRecorder(grpc.aio.ServerInterceptor):
    def __init__(self):
        self.seen: list[tuple] = []

    async def intercept_service(self, continuation, details):
        self.seen.append(tuple(details.invocation_metadata))
        return await continuation(details)


@pytest.fixture
async def tls_server(tiny_app, tmp_path):
    """The real servicer behind a TLS port with a fresh self-signed certificate for 127.0.0.1."""
    from tts_client.pb.tts.v1 import tts_pb2_grpc
    from tts_server.config import ServerConfig
    from tts_server.rpc.servicer import TextToSpeechServicer

    if not shutil.which("openssl"):
        pytest.skip("openssl is needed to make a test certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", key, "-out", cert, "-subj", "/CN=qwen-tts-test",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    recorder = MetadataRecorder()
    server = grpc.aio.server(interceptors=[recorder])
    tts_pb2_grpc.add_TextToSpeechServiceServicer_to_server(
        TextToSpeechServicer(tiny_app.worker, tiny_app.info, ServerConfig()), server)
    creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    yield f"127.0.0.1:{port}", cert.read_bytes(), recorder
    await server.stop(None)


async def test_tls_credentials_and_call_metadata(tls_server, tiny_app):
    address, root_cert, recorder = tls_server
    tts = make_tts(address, dict(credentials=grpc.ssl_channel_credentials(root_cert),
                                 metadata=(("authorization", "Bearer test-token"),)))
    _, up, rec = await speak(tts, tiny_app, [TTSSpeakFrame("Over TLS.")])
    assert not errors(up) and audio_bytes(rec) == 10 * FRAME_BYTES
    assert any(("authorization", "Bearer test-token") in md for md in recorder.seen)
    plain = make_tts(address)  # no TLS: the handshake fails
    _, up, _ = await speak(plain, tiny_app, [TTSSpeakFrame("In clear.")])
    assert errors(up, "UNAVAILABLE")


LOCAL_LLM = dict(LLM_BASE_URL="http://127.0.0.1:11434/v1", LLM_MODEL="llama3.2")
LOCAL_STT = dict(STT_BASE_URL="http://127.0.0.1:8000/v1")


@pytest.mark.parametrize("env,expected", [
    (dict(DEEPGRAM_API_KEY="dg", OPENAI_API_KEY="oa"), ("deepgram", None)),
    (dict(OPENAI_API_KEY="oa"), ("openai", None)),
    (LOCAL_STT | LOCAL_LLM, ("openai", LOCAL_LLM["LLM_BASE_URL"])),
    ({}, "OPENAI_API_KEY"),
    (dict(LLM_BASE_URL="http://127.0.0.1:11434/v1"), "LLM_MODEL"),
    (LOCAL_LLM, "DEEPGRAM_API_KEY"),
])
def test_agent_config_from_env_or_what_is_missing(env, expected):
    if isinstance(expected, str):
        with pytest.raises(AgentSetupError, match=expected):
            AgentConfig.from_env(env)
        return
    cfg = AgentConfig.from_env(env | {"TTS_ADDRESS": "10.0.0.2:50051"})
    assert (cfg.stt_provider, cfg.llm_base_url, cfg.tts_address) == (*expected, "10.0.0.2:50051")


def test_agent_without_keys_exits_with_a_message_not_a_traceback():
    env = {k: v for k, v in os.environ.items()
           if not k.endswith(("_API_KEY", "_BASE_URL", "_MODEL"))}
    out = subprocess.run([sys.executable, "-m", "pipecat_service.agent"], env=env, text=True,
                         capture_output=True, timeout=60, cwd=Path(__file__).parents[1])
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "agent: No LLM configured. Set OPENAI_API_KEY" in out.stderr


async def test_agent_checks_the_tts_server(tiny_server):
    assert "synthetic-tiny" in await check_tts_server(tiny_server)
    with pytest.raises(AgentSetupError, match="make serve"):
        await check_tts_server(f"127.0.0.1:{free_port()}", timeout_s=2.0)
