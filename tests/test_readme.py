"""The README's commands, run as written against loopback servers (tiny model): grpcurl and buf
curl (list, describe, a streamed Synthesize; with a token), and the Python snippet as a script.
If the README and the server drift apart, this fails."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent  # the venv the tests run in: .venv/bin in the README
TOKEN = "readme-token"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def _commands() -> list[str]:
    """Every grpcurl / buf curl command in the README's bash blocks, continuation lines joined."""
    commands = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith((".venv/bin/grpcurl", ".venv/bin/buf curl")):
                commands.append(line)
    return commands


COMMANDS = _commands()


def _json_stream(text: str) -> list[dict]:
    decoder, out, i = json.JSONDecoder(), [], 0
    while (i := _skip_space(text, i)) < len(text):
        obj, i = decoder.raw_decode(text, i)
        out.append(obj)
    return out


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


async def _run(command: str, address: str, cwd: Path | None = None) -> tuple[int, str, str]:
    """A README command through bash, with .venv/bin/ and the address made this test's; awaited
    so the event loop keeps serving the in-process server."""
    command = command.replace(".venv/bin/", f"{BIN}/").replace("127.0.0.1:50051", address)
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
        env={**os.environ, "TOKEN": TOKEN})
    out, err = await asyncio.wait_for(proc.communicate(), 180)
    return proc.returncode, out.decode(), err.decode()


@pytest.fixture
async def token_server(tiny_app):
    from tts_server.config import ServerConfig
    from tts_server.rpc.server import TTSServer

    server = TTSServer(tiny_app.worker, tiny_app.info, ServerConfig(port=0, auth_token=TOKEN),
                       owns_worker=False)
    await server.start()
    yield f"127.0.0.1:{server.port}"
    await server.stop(grace=1.0)


def _check_output(command: str, out: str) -> None:
    if command.endswith(" list") or "--list-methods" in command:
        assert "tts.v1.TextToSpeechService" in out, out
    elif " describe " in command:
        assert "message SynthesizeRequest" in out and "string text = 1;" in out, out
    else:  # grpcurl prints the proto's field names, buf curl JSON's lowerCamelCase
        messages = [_camel(m) for m in _json_stream(out)]
        first, last = messages[0]["audio"], messages[-1]["summary"]
        assert (first["numSamples"], first["numFrames"], first["sampleRateHz"]) == (1920, 1, 24000)
        assert all("audio" in m for m in messages[:-1])
        assert last["finishReason"] in ("FINISH_REASON_MAX_LENGTH", "FINISH_REASON_EOS")
        assert last["numFrames"] == sum(m["audio"]["numFrames"] for m in messages[:-1])


def _camel(obj):
    if isinstance(obj, dict):
        return {re.sub(r"_([a-z])", lambda m: m.group(1).upper(), k): _camel(v)
                for k, v in obj.items()}
    return obj


def test_the_readme_has_the_commands():
    tools = [c.split()[0].rsplit("/", 1)[1] for c in COMMANDS]
    assert tools.count("grpcurl") >= 4 and tools.count("buf") >= 3, COMMANDS
    assert any(" describe " in c for c in COMMANDS)
    example = json.loads(next(b for b in _blocks("json")).splitlines()[0].replace("…", ""))
    assert (example["audio"]["numSamples"], example["audio"]["numFrames"]) == (1920, 1)


@pytest.mark.parametrize("command", [c for c in COMMANDS if "authorization" not in c])
async def test_readme_command(tiny_server, command):
    if not (BIN / command.split()[0].rsplit("/", 1)[1]).exists():
        pytest.skip(f"{command.split()[0]} is not installed (make setup installs it)")
    rc, out, err = await _run(command, tiny_server)
    assert rc == 0, err
    _check_output(command, out)


@pytest.mark.parametrize("command", [c for c in COMMANDS if "authorization" in c])
async def test_readme_command_with_a_token(token_server, command):
    if not (BIN / command.split()[0].rsplit("/", 1)[1]).exists():
        pytest.skip(f"{command.split()[0]} is not installed (make setup installs it)")
    rc, out, err = await _run(command, token_server)
    assert rc == 0, err
    _check_output(command, out)
    # the token is what made it work: reflection answers without it, the call does not
    rc, out, err = await _run(command.replace("$TOKEN", "wrong"), token_server)
    assert rc != 0 and "nauthenticated" in (out + err), (out, err)
    assert "missing or invalid bearer token" in out + err


async def test_reflection_needs_no_token(token_server):
    rc, out, err = await _run(".venv/bin/grpcurl -plaintext 127.0.0.1:50051 describe "
                              "tts.v1.TextToSpeechService", token_server)
    assert rc == 0 and "rpc Synthesize" in out, err


async def test_readme_python_snippet_runs_as_a_script(tiny_server, tmp_path):
    (snippet,) = [b for b in _blocks("python") if "asyncio.run(main())" in b]
    script = tmp_path / "speak.py"
    script.write_text(snippet.replace("127.0.0.1:50051", tiny_server))
    rc, out, err = await _run(".venv/bin/python speak.py", tiny_server, cwd=tmp_path)
    assert rc == 0, err
    seconds = float(re.match(r"([\d.]+) s of audio, first chunk after \d+ ms", out).group(1))
    assert (tmp_path / "hello.pcm").stat().st_size == round(seconds * 16000) * 2


async def test_first_chunk_lengths_the_readme_gives(tiny_server):
    """'979 samples (61 ms) at 16 kHz, 490 at 8 kHz, 3320 (69 ms) at 48 kHz', and whole streams
    of exactly audioSeconds x rate samples."""
    from tts_client.client import TTSClient, build_request

    claims = re.search(r"(\d+) samples \(\d+ ms\) at 16 kHz, (\d+) at 8 kHz, (\d+) \(\d+ ms\) at "
                       r"48 kHz", " ".join(README.split()))
    assert claims, "the README no longer gives the first chunk's length at resampled rates"
    async with TTSClient(tiny_server) as client:
        for rate, expected in zip((16000, 8000, 48000), map(int, claims.groups())):
            msgs = [m async for m in client.chunks(build_request(
                "Hello there.", sample_rate_hz=rate, max_duration_s=0.8, seed=1))]
            assert msgs[0].audio.num_samples == expected and msgs[0].audio.num_frames == 1
            total = sum(m.audio.num_samples for m in msgs[:-1])
            assert total == round(msgs[-1].summary.audio_seconds * rate) == 10 * rate * 8 // 100
