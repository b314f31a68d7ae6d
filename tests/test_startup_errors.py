"""Start-up mistakes end `tts-server` at once: exit status 2 and one line naming the flag, before
any model is loaded (no traceback, no synthetic-model warning)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _start(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tts_server", "--metrics-port", "-1",
                           "--http-port", "-1", *args],
                          capture_output=True, text=True, timeout=120)


def _assert_one_line(res: subprocess.CompletedProcess, expected: str) -> None:
    lines = [line for line in (res.stdout + res.stderr).splitlines() if line.strip()]
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1, lines
    assert expected in lines[0], lines[0]
    assert "Traceback" not in res.stderr and "SYNTHETIC MODEL" not in res.stderr


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("startup")
    (d / "not-a-snapshot").mkdir()
    (d / "other-model").mkdir()
    (d / "other-model" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (d / "half-snapshot").mkdir()
    (d / "half-snapshot" / "config.json").write_text(json.dumps({"model_type": "qwen3_tts"}))
    (d / "empty-token").write_text("\n")
    (d / "text.pem").write_text("hello\n")
    return d


@pytest.mark.parametrize("args,expected", [
    (["--model", "{d}/missing"], "--model {d}/missing: no such folder"),
    (["--model", "{d}/not-a-snapshot"], "not a Qwen3-TTS snapshot (config.json: No such file"),
    (["--model", "{d}/other-model"], "model_type llama, expected qwen3_tts"),
    (["--model", "{d}/half-snapshot"], "lacks its speech_tokenizer/ folder"),
    (["--model", "{d}/empty-token"], "not a folder"),
    (["--engine", "batched", "--device", "cpu"], "--engine batched runs on a CUDA GPU only"),
    (["--tls-cert", "{d}/text.pem"], "--tls-cert needs --tls-key too"),
    (["--tls-key", "{d}/text.pem"], "--tls-key needs --tls-cert too"),
    (["--tls-cert", "{d}/text.pem", "--tls-key", "{d}/text.pem"],
     "--tls-cert {d}/text.pem: no PEM certificate in this file"),
    (["--tls-cert", "{d}/missing.pem", "--tls-key", "{d}/text.pem"],
     "--tls-cert {d}/missing.pem: no such file or directory"),
    (["--auth-token-file", "{d}/missing"], "--auth-token-file {d}/missing: no such file"),
    (["--auth-token-file", "{d}/empty-token"], "the first line is empty"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["--device", "gpu"], "--device must be auto, cpu, cuda or cuda:N, got gpu"),
    (["--device", "cpu", "--devices", "1,1"], "--devices '1,1': each GPU number once"),
    (["--device", "cpu", "--devices", "0,x"], "--devices '0,x': expected 'all' or GPU numbers"),
    (["--max-streams", "0"], "--max-streams must be at least 1, got 0"),
    (["--max-streams", "many"], "argument --max-streams: invalid int value: 'many'"),
    (["--max-queue", "-1"], "--max-queue must be at least 0, got -1"),
    (["--max-queue-wait-s", "-1"], "--max-queue-wait-s must be a positive number of seconds"),
    (["--stall-timeout-s", "0"], "--stall-timeout-s must be a positive number of seconds"),
    (["--grace-period-s", "-5"], "--grace-period-s must be at least 0, got -5"),
    (["--player-preroll-ms", "-20"], "--player-preroll-ms must be at least 0, got -20"),
    (["--port", "70000"], "--port must be 0-65535"),
    (["--metrics-port", "-2"], "--metrics-port must be 0-65535"),
    (["--chunk-frames", "1,x"], "--chunk-frames must be comma-separated frame counts"),
    (["--chunk-frames", "0,4"], "--chunk-frames must be positive frame counts"),
    (["--log-level", "loud"], "argument --log-level: invalid choice"),
    (["--frame-kernel", "cuda", "--device", "cpu"], "--frame-kernel cuda is a batched-engine option on a CUDA GPU"),
    (["--frame-kernel", "cuda-predict", "--engine", "torch"], "--frame-kernel cuda-predict is a batched-engine option"),
    (["--frame-kernel", "fast"], "argument --frame-kernel: invalid choice: 'fast'"),
])
def test_startup_mistake_is_one_line(files, args, expected):
    args = [a.format(d=files) for a in args]
    _assert_one_line(_start(*args), expected.format(d=files))


def test_wrong_key_for_the_certificate(files, tmp_path):
    for name in ("a", "b"):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-keyout", str(tmp_path / f"{name}.key"), "-out", str(tmp_path / f"{name}.pem"),
                        "-subj", "/CN=localhost"], check=True, capture_output=True)
    res = _start("--tls-cert", str(tmp_path / "a.pem"), "--tls-key", str(tmp_path / "b.key"))
    _assert_one_line(res, f"--tls-key {tmp_path}/b.key is not the private key of --tls-cert")


def test_port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = _start("--model", "synthetic-tiny", "--port", str(port))
    _assert_one_line(res, f"--port {port}: already in use on 127.0.0.1")


def test_http_port_in_use_or_the_grpc_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = _start("--model", "synthetic-tiny", "--port", "0", "--http-port", str(port))
    _assert_one_line(res, f"--http-port {port}: already in use on 127.0.0.1")
    res = _start("--model", "synthetic-tiny", "--port", "50999", "--http-port", "50999")
    _assert_one_line(res, "--http-port 50999 is also --port")


@pytest.mark.skipif("_has_cuda()", reason="this machine has CUDA; the error is for machines without")
@pytest.mark.parametrize("args,expected", [
    (["--device", "cuda"], "--device cuda needs a CUDA GPU, and torch sees none"),
    (["--engine", "megakernel"], "--engine megakernel needs a CUDA GPU"),
    (["--engine", "batched"], "--engine batched needs a CUDA GPU"),
    (["--devices", "all"], "--devices all needs GPUs and none is visible"),
    (["--frame-kernel", "cuda"], "--frame-kernel cuda needs a CUDA GPU"),
])
def test_cuda_asked_for_without_cuda(args, expected):
    _assert_one_line(_start(*args), expected)


def test_json_log_format_reports_a_usage_error_as_one_json_line():
    res = _start("--log-format", "json", "--max-streams", "many")
    assert res.returncode == 2
    (line,) = res.stderr.splitlines()
    record = json.loads(line)
    assert record["level"] == "CRITICAL"
    assert "argument --max-streams: invalid int value: 'many'" in record["message"]
    assert not res.stdout


def test_json_log_format_reports_it_as_one_json_line(files):
    res = _start("--log-format", "json", "--model", str(files / "missing"))
    assert res.returncode == 2
    (line,) = res.stderr.splitlines()
    record = json.loads(line)
    assert record["level"] == "CRITICAL" and "no such folder" in record["message"]
    assert record["time"].endswith("Z") and "T" in record["time"]


@pytest.mark.slow
def test_unknown_default_voice_is_one_line():
    """Checked once the model's voices are known (after loading), still one line, exit 2."""
    res = _start("--model", "synthetic-tiny", "--port", "0", "--default-voice", "bob")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].endswith(
        "cannot start: --default-voice bob: the model has no such voice; choose one of aiden, "
        "eric, ryan, vivian")


@pytest.mark.slow
def test_hub_id_that_cannot_be_fetched_is_one_line():
    res = subprocess.run([sys.executable, "-m", "tts_server", "--metrics-port", "-1", "--model",
                          "nobody/no-such-model"], capture_output=True, text=True, timeout=180,
                         env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 2 and "Traceback" not in res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert "cannot start: --model nobody/no-such-model: could not load it as a hub id" in line


def test_megakernel_without_its_library_says_how_to_build_it(monkeypatch):
    """The GPU-machine case, where this machine has no GPU: CUDA stubbed as present, the kernel
    library pointed at a file that does not exist."""
    import torch

    from tts_server import preflight
    from tts_server.memory_plan import StartupError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("QMK_LIB", "/nonexistent/libqwen_megakernel.so")
    with pytest.raises(StartupError, match=r"kernel library is not built; build it with `make kernel`"):
        preflight.check_device("megakernel", "auto", "auto")


def test_event_loop_uvloop_without_uvloop_is_one_line_and_auto_falls_back(monkeypatch):
    """--event-loop uvloop where uvloop is not installed is a start-up mistake (one line); auto
    then runs on asyncio's loop, and on uvloop's where it is installed."""
    import asyncio

    from tts_server import aio, preflight
    from tts_server.memory_plan import StartupError

    async def loop_type():
        return type(asyncio.get_running_loop()).__module__

    if aio.available("uvloop"):
        assert aio.run(loop_type(), "auto").startswith("uvloop")
    assert aio.run(loop_type(), "asyncio").startswith("asyncio")
    monkeypatch.setattr(aio, "_uvloop", lambda: None)
    with pytest.raises(StartupError, match=r"--event-loop uvloop: uvloop is not installed"):
        preflight.check_event_loop("uvloop")
    preflight.check_event_loop("auto")
    assert aio.run(loop_type(), "auto").startswith("asyncio")
