"""The console scripts as users run them: tts-server in its own process, tts-client say, SIGTERM."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import soundfile

from tts_client.bench import free_port
from tts_client.client import TTSClient, build_request

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    port, http_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tts_server", "--model", "synthetic-tiny",
                                 "--port", str(port), "--http-port", str(http_port),
                                 "--grace-period-s", "20"],
                                stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while "serving tts.v1.TextToSpeechService" not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.5)
    proc.http_base = f"http://127.0.0.1:{http_port}/v1"
    yield proc, f"127.0.0.1:{port}", log
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_server_logs_model_and_synthetic_warning(server_process):
    _, _, log = server_process
    text = log.read_text()
    assert "model synthetic-tiny (custom_voice, 0b6) engine=torch" in text
    assert "SYNTHETIC MODEL" in text and "noise" in text
    frozen = re.search(r"(\d+) start-up objects frozen out of the garbage collector", text)
    assert frozen and int(frozen.group(1)) > 10_000  # the model's objects: no full-heap GC pauses
    took = re.search(r"start-up took (\d+) s", text)  # (on a GPU, with where Triton caches the kernels)
    assert took and 0 <= int(took.group(1)) < 120


def test_client_say_writes_a_playable_wav(server_process, tmp_path):
    _, address, _ = server_process
    wav = tmp_path / "hello.wav"
    out = subprocess.run([sys.executable, "-m", "tts_client.cli", "--address", address, "say",
                          "Hello there.", "-o", str(wav), "--seed", "3"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "time to first chunk:" in out and "real-time factor:" in out
    samples, rate = soundfile.read(wav)
    assert rate == 24000 and samples.shape[0] % 1920 == 0 and samples.shape[0] > 0
    assert np.abs(samples).max() > 0.01
    info = soundfile.info(wav)
    assert info.format == "WAV" and info.subtype == "PCM_16" and info.channels == 1


def test_openai_sdk_script_streams_a_wav(server_process, tmp_path):
    proc, _, _ = server_process
    wav = tmp_path / "sdk.wav"
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "openai_sdk_speech.py")
    err = subprocess.run([sys.executable, script, "Hello there.", "-o", str(wav), "--model",
                          "synthetic-tiny", "--base-url", proc.http_base, "--seed", "3"],
                         capture_output=True, text=True, timeout=120, check=True).stderr
    assert "first bytes after" in err and "24000 Hz wav" in err
    samples, rate = soundfile.read(wav)  # streamed WAV: the header's length fields are unknown
    assert rate == 24000 and samples.shape[0] % 1920 == 0 and samples.shape[0] > 0


def test_sigterm_drains_in_flight_stream_then_exits_cleanly(server_process):
    proc, address, log = server_process

    async def run():
        async with TTSClient(address) as client:
            call = client.stream(build_request("Drain me.", max_duration_s=2.0, seed=1))
            msgs = []
            async for msg in call:
                if not msgs:  # the stream is in flight
                    proc.send_signal(signal.SIGTERM)
                msgs.append(msg)
            return msgs

    msgs = asyncio.run(run())
    assert msgs[-1].HasField("summary") and msgs[-1].summary.num_frames == 25
    assert proc.wait(timeout=60) == 0
    assert "SIGTERM: draining" in log.read_text()
