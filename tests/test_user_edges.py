"""Edges a new user meets first: refused calls say which request and why (logs and
`x-request-id`), deadlines are logged as deadlines, FLOAT32 stays in [-1, 1], error messages read
as prose, and the CLI fails early and helpfully."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys

import grpc
import numpy as np
import pytest

from tts_client.bench import free_port
from tts_client.client import TTSClient, build_request
from tts_client.pb.tts.v1 import tts_pb2


def _metadata(err: grpc.aio.AioRpcError) -> dict:
    return {**dict(err.initial_metadata() or ()), **dict(err.trailing_metadata() or ())}


async def test_refused_request_logs_its_id_and_reason_and_returns_it(tiny_server, caplog):
    caplog.set_level(logging.INFO, logger="tts_server")
    async with TTSClient(tiny_server) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.synthesize(build_request("Hi.", voice="nobody", request_id="bad-voice-1"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert _metadata(err.value)["x-request-id"] == "bad-voice-1"
        # an id the server cannot use (invalid characters) is replaced by a generated one
        with pytest.raises(grpc.aio.AioRpcError) as err2:
            await client.synthesize(build_request("Hi.", request_id="no spaces allowed"))
        generated = _metadata(err2.value)["x-request-id"]
        assert len(generated) == 16 and err2.value.details().startswith("request_id:")
    lines = [r.getMessage() for r in caplog.records]
    assert any("bad-voice-1" in m and "INVALID_ARGUMENT" in m and 'unknown voice "nobody"' in m
               for m in lines), lines
    assert any(generated in m and "request_id:" in m for m in lines), lines
    record = next(r for r in caplog.records if "bad-voice-1" in r.getMessage())
    assert record.request_id == "bad-voice-1" and record.code == "INVALID_ARGUMENT"


async def test_error_messages_read_as_prose(tiny_server):
    async with TTSClient(tiny_server) as client:
        for kwargs in ({"voice": "nobody"}, {"language": "klingon"}):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.synthesize(build_request("Hi.", **kwargs))
            details = err.value.details()
            assert "'" not in details and "(" not in details.split(";")[0], details


async def test_deadline_is_logged_as_a_deadline(tiny_server, caplog):
    caplog.set_level(logging.INFO, logger="tts_server")
    async with TTSClient(tiny_server) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            # seed 1: no EOS in its first 100 frames (a random seed drew one at frame 23 once,
            # and the stream ended before the deadline)
            await client.synthesize(build_request("A long one.", max_duration_s=30.0, seed=1,
                                                  request_id="late-1"), timeout=1.0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        call = client.stream(build_request("Cancel me.", max_duration_s=30.0, request_id="gone-1"))
        async for _ in call:
            call.cancel()
            break
    for _ in range(50):  # the handlers log as they unwind
        messages = [r.getMessage() for r in caplog.records if r.name.startswith("tts_server")]
        if any("late-1" in m and "deadline" in m for m in messages) and any(
                "gone-1" in m and "cancelled" in m for m in messages):
            break
        await asyncio.sleep(0.1)
    late = [m for m in messages if "late-1" in m]
    assert any("deadline passed" in m for m in late), messages
    assert not any("cancelled" in m for m in late), late
    assert any("gone-1" in m and "cancelled by the client" in m for m in messages), messages


def test_float32_output_is_clipped_to_the_promised_range():
    from tts_server.api import AudioChunk
    from tts_server.rpc.convert import chunk_message

    chunk = AudioChunk(np.array([-1.7, -0.5, 0.25, 1.3], np.float32), 0, 1, 0)
    msg = chunk_message(chunk, 24000, tts_pb2.AUDIO_ENCODING_FLOAT32_LE)
    samples = np.frombuffer(msg.audio.audio, "<f4")
    np.testing.assert_array_equal(samples, [-1.0, -0.5, 0.25, 1.0])


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tts_client.cli", *args], capture_output=True,
                          text=True, timeout=60)


def test_say_into_a_missing_folder_fails_before_calling(tmp_path):
    address = f"127.0.0.1:{free_port()}"  # nothing listens: the check must come first
    res = _cli("--address", address, "say", "Hi.", "-o", str(tmp_path / "nope" / "hi.wav"))
    assert res.returncode == 2
    assert res.stderr.strip() == (f"tts-client: error: -o {tmp_path}/nope/hi.wav: the folder "
                                  f"{tmp_path}/nope does not exist")
    res = _cli("--address", address, "--tls-ca", str(tmp_path / "ca.pem"), "voices")
    assert res.returncode == 2 and "--tls-ca" in res.stderr and "no such file" in res.stderr
    assert "Traceback" not in res.stderr


def test_no_server_gets_a_hint(tmp_path):
    res = _cli("--address", f"127.0.0.1:{free_port()}", "info")
    assert res.returncode == 1 and res.stderr.startswith("error: UNAVAILABLE")
    assert "hint: is a server running on" in res.stderr and "--tls-ca" in res.stderr


@pytest.mark.slow
def test_json_logs_are_the_only_output(tmp_path):
    """A real server process with --log-format json: a good call, a refused one, a cancelled one
    and SIGTERM; every line it writes to stdout and stderr is a JSON object with a UTC time."""
    import json
    import signal
    import time

    port = free_port()
    out, err = open(tmp_path / "out", "w+"), open(tmp_path / "err", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "tts_server", "--model", "synthetic-tiny",
                             "--port", str(port), "--log-format", "json", "--metrics-port", "-1"],
                            stdout=out, stderr=err)
    try:
        deadline = time.monotonic() + 180
        while "serving tts.v1" not in (tmp_path / "err").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "err").read_text()
            time.sleep(0.5)

        async def calls():
            async with TTSClient(f"127.0.0.1:{port}") as client:
                await client.synthesize(build_request("Hi.", max_duration_s=0.16, seed=1))
                with pytest.raises(grpc.aio.AioRpcError):
                    await client.synthesize(build_request("Hi.", voice="nobody"))
                call = client.stream(build_request("Bye.", max_duration_s=10.0))
                async for _ in call:
                    call.cancel()
                    break

        asyncio.run(calls())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = (tmp_path / "out").read_text().splitlines() + (tmp_path / "err").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # fails on any non-JSON line
    assert all(r["time"].endswith("Z") and "T" in r["time"] for r in records)
    messages = " | ".join(r["message"] for r in records)
    assert "ended with INVALID_ARGUMENT" in messages and "cancelled by the client" in messages
    assert "SIGTERM: draining" in messages


def test_a_crash_in_json_mode_is_a_json_record():
    import json

    code = ("from tts_server.logs import setup_logging; setup_logging('INFO', 'json'); "
            "import threading; t = threading.Thread(target=lambda: 1 / 0, name='w'); t.start(); "
            "t.join(); raise RuntimeError('boom')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and not res.stdout
    records = [json.loads(line) for line in res.stderr.splitlines()]
    assert [r["message"] for r in records] == ["uncaught ZeroDivisionError in thread w: division by zero",
                                               "uncaught RuntimeError: boom"]
    assert all("Traceback" in r["exc_info"] for r in records)


def test_output_while_importing_becomes_a_log_record():
    """What libraries print when imported (fd-level: a child shell's stderr too) is captured."""
    import json

    code = ("import os, sys; from tts_server.logs import quiet_imports, setup_logging; "
            "setup_logging('DEBUG', 'json')\n"
            "with quiet_imports():\n    print('banner'); os.system('echo shell-noise >&2')\n"
            "try:\n    with quiet_imports():\n        print('half'); raise ImportError('x')\n"
            "except ImportError:\n    pass\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and not res.stdout, res.stdout
    records = [json.loads(line) for line in res.stderr.splitlines()]
    assert [(r["level"], r["message"]) for r in records] == [
        ("DEBUG", "output while importing: banner\nshell-noise"),
        ("ERROR", "output while importing: half")]
