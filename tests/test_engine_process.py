"""`--engine-process`: the engines in a child process behind the same gRPC server. Real loopback
servers and a real child process (tiny model): the same bytes as the in-process server, the same
refusals, cancellation that frees the engine's slot, incremental text, the engine's metrics on
the server's port, a failed stream or engine reported as in-process, and a dead engine process
ending every stream UNAVAILABLE."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from test_devices import _until
from tts_client.client import TTSClient, build_request

pytestmark = pytest.mark.slow


def _config(**overrides):
    from tts_server.config import ServerConfig

    base = dict(model="synthetic-tiny", engine="torch", device="cpu", port=0, max_streams=4,
                max_queue=1, metrics_port=0, http_port=0, engine_process=True)
    return ServerConfig(**{**base, **overrides})


async def _start(config):
    from tts_server.rpc.server import TTSServer
    from tts_server.serving.remote import RemoteWorker

    proc, conns = RemoteWorker.spawn(config)
    worker = await asyncio.to_thread(RemoteWorker.connect, proc, conns[0])
    worker.start()
    server = TTSServer(worker, worker.info, config)
    await server.start()
    return server, worker


async def _stop(server, worker):
    await server.stop(grace=0.5)
    if worker.proc.poll() is None:
        await asyncio.to_thread(worker.stop, 10.0)


@pytest.fixture
async def remote():
    server, worker = await _start(_config())
    yield f"127.0.0.1:{server.port}", worker, server
    await _stop(server, worker)
    assert worker.proc.returncode == 0, "the engine process did not exit cleanly"


async def _audio(address, request):
    async with TTSClient(address) as client:
        return (await client.synthesize(request, timeout=120)).samples


async def _outcome(address, request):
    try:
        async with TTSClient(address) as client:
            return (await client.synthesize(request, timeout=60)).summary.num_frames
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()


async def _wait_idle(worker, timeout=20.0):
    deadline = time.monotonic() + timeout
    while worker.num_outstanding and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert worker.num_outstanding == 0


def _scrape(port) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_same_bytes_as_the_in_process_server_alone_and_among_others(remote, tiny_server):
    address, worker, _ = remote
    for rate in (0, 16000):
        request = build_request("The same words, the same seed, the same audio.", seed=77,
                                max_duration_s=1.6, sample_rate_hz=rate)
        here = await _audio(tiny_server, request)
        there = await _audio(address, request)
        assert here.size > 0 and there.shape == here.shape
        assert np.array_equal(there, here), f"{np.count_nonzero(there != here)} samples differ"
        others = [asyncio.create_task(_audio(address, build_request(f"Neighbour {i}.", seed=i,
                                                                    max_duration_s=1.2)))
                  for i in range(3)]
        crowded = await _audio(address, request)
        await asyncio.gather(*others)
        assert np.array_equal(crowded, here)
    await _wait_idle(worker)


async def _in_process_speech(tiny_custom, body):
    """The in-process server's HTTP response to `body` (the reference bytes)."""
    import httpx

    from http_helpers import start_server, stop_servers

    started = []
    try:
        base, _, _, _ = await start_server(tiny_custom, started)
        async with httpx.AsyncClient(timeout=60) as client:
            return await client.post(base + "/v1/audio/speech", json=body)
    finally:
        await stop_servers(started)


async def test_the_http_api_gives_the_in_process_bytes(remote, tiny_custom):
    import httpx

    address, worker, server = remote
    body = {"model": "synthetic-tiny", "input": "Over HTTP too.", "voice": "ryan", "seed": 5,
            "max_duration_s": 1.2, "response_format": "pcm"}
    here = await _in_process_speech(tiny_custom, body)
    async with httpx.AsyncClient(timeout=60) as client:
        there = await client.post(f"http://127.0.0.1:{server.http_port}/v1/audio/speech", json=body)
    assert here.status_code == there.status_code == 200, there.text
    assert len(there.content) > 0 and there.content == here.content
    await _wait_idle(worker)


async def test_refusals_are_decided_in_the_server_process(remote):
    address, worker, _ = remote
    # 4 slots + 1 queue place: the sixth concurrent request is refused at once
    long = [asyncio.create_task(_outcome(address, build_request(f"Long stream {i}.", seed=i,
                                                                max_duration_s=30)))
            for i in range(5)]
    deadline = time.monotonic() + 20
    while worker.num_outstanding < 5 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    refused = await _outcome(address, build_request("One too many.", max_duration_s=0.2))
    assert refused[0] == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
    assert "busy" in refused[1]
    bad = await _outcome(address, build_request("Hi.", voice="nobody"))
    assert bad[0] == grpc.StatusCode.INVALID_ARGUMENT and "voice" in bad[1], bad
    for task in long:
        task.cancel()
    await asyncio.gather(*long, return_exceptions=True)
    await _wait_idle(worker)
    assert await _outcome(address, build_request("Still serving.", seed=5, max_duration_s=0.4)) == 5


async def test_a_client_hang_up_frees_the_engine_slot(remote):
    address, worker, server = remote
    async with TTSClient(address) as client:
        call = client.chunks(build_request("A long stream the client abandons.", max_duration_s=60, seed=1))
        got = 0
        async for msg in call:
            got += msg.HasField("audio")
            if got == 2:
                break
        await call.aclose()
    await _wait_idle(worker)
    deadline = time.monotonic() + 10  # the engine's series come every 0.5 s
    while time.monotonic() < deadline:
        m = _scrape(server.metrics_port)
        if m.get(("tts_active_streams", (("device", "cpu"),))) == 0:
            break
        await asyncio.sleep(0.2)
    assert m[("tts_active_streams", (("device", "cpu"),))] == 0
    assert m[("tts_frames_total", (("device", "cpu"),))] >= 2
    assert m[("tts_stream_slots", (("device", "cpu"),))] == 4
    assert m[("tts_engine_process_resident_memory_bytes", ())] > m[("process_resident_memory_bytes", ())] / 10
    assert await _outcome(address, build_request("Next.", seed=6, max_duration_s=0.4)) == 5


async def _speak(address, pieces):
    """One StreamSynthesize context fed `pieces`, then ended: its audio and its `done`."""
    async with TTSClient(address) as client:
        call = client.text_stream(timeout=120)
        await call.open("c", greedy=True, seed=5, max_duration_s=2.0)
        for piece in pieces:
            await call.text("c", piece)
        await call.end("c")
        result = (await call.collect({"c"}))["c"]
        await call.close()
        return result


async def test_incremental_text_gives_the_in_process_bytes(remote, tiny_server):
    address, worker, _ = remote
    pieces = ["Words arr", "ive one ", "by one, ", "as an LLM", " writes them."]
    here, there = await _speak(tiny_server, pieces), await _speak(address, pieces)
    assert there.done.num_frames == here.done.num_frames > 0
    assert there.audio.size > 0 and np.array_equal(there.audio, here.audio)
    await _wait_idle(worker)


async def test_a_failed_stream_and_a_failed_engine_as_in_process():
    server, worker = await _start(_config(
        inject_fault="stream_error:bad-1@3,device_error:dev-1@2", max_queue=4))
    address = f"127.0.0.1:{server.port}"
    try:
        ok, bad = await asyncio.gather(
            _outcome(address, build_request("Fine.", seed=7, max_duration_s=0.8, request_id="ok-1")),
            _outcome(address, build_request("Broken.", seed=8, max_duration_s=0.8, request_id="bad-1")))
        assert ok == 10
        assert bad[0] == grpc.StatusCode.INTERNAL and "non-finite" in bad[1], bad
        assert worker.failure is None
        bystander = asyncio.ensure_future(_outcome(address, build_request(
            "A bystander.", max_duration_s=30, seed=1, request_id="bystander")))
        await asyncio.sleep(0.3)
        dev = await _outcome(address, build_request("Boom.", max_duration_s=30, seed=2, request_id="dev-1"))
        for outcome in (dev, await bystander):
            assert outcome[0] == grpc.StatusCode.UNAVAILABLE, outcome
        assert "illegal memory access" in dev[1]
        assert worker.failure is not None
        await _until(lambda: server.failure is not None, 5)  # told after the streams end (see below)
        async with grpc.aio.insecure_channel(address) as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
        assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await _stop(server, worker)


async def test_an_engine_process_that_dies_ends_every_stream_unavailable():
    server, worker = await _start(_config())
    address = f"127.0.0.1:{server.port}"
    try:
        streams = [asyncio.ensure_future(_outcome(address, build_request(
            f"Stream {i}.", max_duration_s=30, seed=i))) for i in range(2)]
        deadline = time.monotonic() + 20
        while worker.num_outstanding < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        os.kill(worker.proc.pid, signal.SIGKILL)
        for outcome in await asyncio.gather(*streams):
            assert outcome[0] == grpc.StatusCode.UNAVAILABLE, outcome
            assert "engine process ended" in outcome[1]
        # the worker ends the streams, then tells the server's loop (call_soon_threadsafe): the
        # calls may finish first
        await _until(lambda: server.failure is not None, 5)
        assert worker.num_outstanding == 0
    finally:
        await _stop(server, worker)


def test_a_start_up_mistake_in_the_engine_process_is_one_line_and_status_2(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "tts-server")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "tts_server"]
    r = subprocess.run(cmd + ["--engine-process", "--model", "synthetic-tiny", "--device", "cpu",
                              "--port", "0", "--http-port", "-1", "--metrics-port", "-1",
                              "--default-voice", "nobody"],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert "cannot start: --default-voice nobody" in last, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_the_engine_process_is_the_default_on_a_gpu_only():
    import torch

    from tts_server.__main__ import parse_args, uses_engine_process

    assert uses_engine_process(parse_args(["--device", "cuda:0"]))
    assert uses_engine_process(parse_args(["--devices", "all"]))
    assert not uses_engine_process(parse_args(["--device", "cpu"]))
    assert not uses_engine_process(parse_args(["--device", "cuda", "--no-engine-process"]))
    assert uses_engine_process(parse_args(["--device", "cpu", "--engine-process"]))
    assert uses_engine_process(parse_args([])) == torch.cuda.is_available()


def test_rpc_processes_auto_is_one_per_four_cores_up_to_four_on_a_gpu_with_the_engine_process(monkeypatch):
    import tts_server.__main__ as cli
    from tts_server.__main__ import parse_args, resolve_rpc_processes

    assert parse_args([]).rpc_processes is None  # auto is the default
    assert parse_args(["--rpc-processes", "AUTO"]).rpc_processes is None
    assert parse_args(["--rpc-processes", "3"]).rpc_processes == 3
    for cores, want in ((2, 1), (7, 1), (8, 2), (16, 4), (128, 4)):
        monkeypatch.setattr(cli, "usable_cores", lambda cores=cores: cores)
        assert resolve_rpc_processes(parse_args(["--device", "cuda:0"])).rpc_processes == want, cores
        assert resolve_rpc_processes(parse_args(["--device", "cpu"])).rpc_processes == 1  # no engine process
        assert resolve_rpc_processes(parse_args(["--device", "cpu", "--engine-process"])).rpc_processes == 1
        assert resolve_rpc_processes(parse_args(["--devices", "0,1"])).rpc_processes == want
        assert resolve_rpc_processes(parse_args(["--device", "cuda", "--no-engine-process"])).rpc_processes == 1
        assert resolve_rpc_processes(parse_args(["--device", "cuda:0", "--rpc-processes", "1"])).rpc_processes == 1


def test_ctrl_c_to_the_process_group_drains_and_leaves_no_engine_process(tmp_path):
    """Ctrl-C in a terminal signals the server and its engine process alike: the server drains
    its in-flight stream and exits 0; the engine process ends with it."""
    import re

    from tts_client.bench import free_port

    port, log_path = free_port(), tmp_path / "server.log"
    with open(log_path, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tts_server", "--engine-process", "--model", "synthetic-tiny",
             "--device", "cpu", "--port", str(port), "--http-port", "-1", "--metrics-port", "-1"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while "serving tts.v1.TextToSpeechService" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-2000:]
            time.sleep(0.3)
        engine_pid = int(re.search(r"engine process (\d+)", log_path.read_text()).group(1))

        async def run():
            async with TTSClient(f"127.0.0.1:{port}") as client:
                msgs = []
                async for msg in client.stream(build_request("Drain me.", max_duration_s=2.0, seed=1)):
                    if not msgs:  # in flight: Ctrl-C
                        os.killpg(proc.pid, signal.SIGINT)
                    msgs.append(msg)
                return msgs

        msgs = asyncio.run(run())
        assert proc.wait(timeout=60) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert msgs[-1].HasField("summary") and msgs[-1].summary.num_frames == 25
    assert "draining" in log_path.read_text()
    deadline = time.monotonic() + 10
    while _alive(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(engine_pid), "the engine process outlived the server"


# ---- several RPC processes (--rpc-processes) ----------------------------------------------
class _Cli:
    """`tts-server --rpc-processes N` on the CPU (tiny model, JSON logs) in its own session."""

    def __init__(self, tmp_path, *args, http_port: int = -1):
        from tts_client.bench import free_port

        self.port, self.metrics_port = free_port(), free_port()
        self.log_path = tmp_path / "server.log"
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tts_server", "--model", "synthetic-tiny", "--device", "cpu",
                 "--port", str(self.port), "--http-port", str(http_port), "--metrics-port",
                 str(self.metrics_port), "--log-format", "json", *args],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 180
        while "more RPC processes on port" not in self.log_path.read_text():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.text()[-3000:]
            time.sleep(0.3)
        time.sleep(1.0)  # the extra RPC processes bind the port a moment later

    def text(self) -> str:
        return self.log_path.read_text()

    def records(self) -> list[dict]:
        import json

        return [json.loads(line) for line in self.text().splitlines() if line.startswith("{")]

    def pids(self) -> tuple[set[int], set[int]]:
        """The engine process's and the extra RPC processes' pids, from the log."""
        import re

        engine, rpc = set(), set()
        for r in self.records():
            if m := re.match(r"engine process (\d+):", r["message"]):
                engine.add(int(m.group(1)))
            if m := re.search(r"RPC processes on port \d+: ([\d, ]+)", r["message"]):
                rpc |= {int(p) for p in m.group(1).split(", ")}
        return engine, rpc

    def close(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _alive(pid) -> bool:  # a zombie (state Z) has ended
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def _on_own_channel(address, request, timeout=120):
    """A call on a channel (and connection) of its own: the kernel picks its RPC process."""
    try:
        async with TTSClient(address, options=[("grpc.use_local_subchannel_pool", 1)]) as client:
            return (await client.synthesize(request, timeout=timeout)).samples
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()


async def test_two_rpc_processes_serve_the_same_bytes_count_every_call_and_drain(tmp_path, tiny_server):
    request = build_request("Any process, the same audio.", seed=21, max_duration_s=0.4)
    expected = await _audio(tiny_server, request)
    cli = _Cli(tmp_path, "--rpc-processes", "2")
    try:
        address = f"127.0.0.1:{cli.port}"
        got = await asyncio.gather(*(_on_own_channel(address, request) for _ in range(16)))
        for samples in got:
            assert isinstance(samples, np.ndarray) and np.array_equal(samples, expected), samples
        done = {r["pid"] for r in cli.records() if r["message"].startswith("request ")
                and " done: " in r["message"]}
        assert len(done) == 2, f"calls were served by {len(done)} process(es)"  # 16 connections
        deadline = time.monotonic() + 10  # the extra process's series come every 0.5 s
        while _scrape(cli.metrics_port).get(("tts_requests_total", (("code", "OK"),))) != 16:
            assert time.monotonic() < deadline, _scrape(cli.metrics_port)
            await asyncio.sleep(0.2)
        assert _scrape(cli.metrics_port)[("tts_time_to_first_chunk_seconds_count", ())] == 16
        engine, rpc = cli.pids()
        children = engine | rpc
        assert len(engine) == 1 and len(rpc) == 1
        cli.proc.send_signal(signal.SIGTERM)  # to the server process only: it drains the others
        assert await asyncio.to_thread(cli.proc.wait, 60) == 0, cli.text()[-3000:]
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not any(_alive(p) for p in children), "a child process outlived the server"
        drains = [r for r in cli.records() if "SIGTERM: draining" in r["message"]]
        assert len({r["pid"] for r in drains}) == 2
        frozen = [r for r in cli.records() if "objects frozen out of the garbage collector" in r["message"]]
        assert {r["pid"] for r in frozen} == {cli.proc.pid} | rpc  # each RPC process, as the server's
    finally:
        cli.close()


async def test_every_rpc_process_serves_the_http_api_on_the_one_port(tmp_path, tiny_custom):
    import re

    import httpx

    body = {"model": "synthetic-tiny", "input": "Any process, over HTTP.", "voice": "ryan", "seed": 8,
            "max_duration_s": 0.4, "response_format": "pcm"}
    expected = await _in_process_speech(tiny_custom, body)
    assert expected.status_code == 200 and expected.content, expected.text
    # any free port: the extra process gets the one the server process bound
    cli = _Cli(tmp_path, "--rpc-processes", "2", http_port=0)
    try:
        (port,) = {int(m.group(1)) for r in cli.records()
                   if (m := re.search(r"speech API on http://[\d.]+:(\d+)/", r["message"]))}
        assert any(f"and HTTP port {port}" in r["message"] for r in cli.records())

        async def on_own_connection():  # a client (and connection) per request: the kernel picks the process
            async with httpx.AsyncClient(timeout=120) as client:
                return await client.post(f"http://127.0.0.1:{port}/v1/audio/speech", json=body)

        got = await asyncio.gather(*(on_own_connection() for _ in range(16)))
        for r in got:
            assert r.status_code == 200 and r.content == expected.content, r.text[:300]
        done = {r["pid"] for r in cli.records() if " done (http): " in r["message"]}
        assert len(done) == 2, f"HTTP requests were served by {len(done)} process(es)"
        deadline = time.monotonic() + 10  # the extra process's series come every 0.5 s
        while _scrape(cli.metrics_port).get(("tts_requests_total", (("code", "OK"),))) != 16:
            assert time.monotonic() < deadline, _scrape(cli.metrics_port)
            await asyncio.sleep(0.2)
    finally:
        cli.close()


async def test_the_engine_refuses_for_every_rpc_process_and_a_lost_one_fails_the_server(tmp_path):
    cli = _Cli(tmp_path, "--rpc-processes", "2", "--max-streams", "1", "--max-queue", "0")
    try:
        address = f"127.0.0.1:{cli.port}"
        outcomes = await asyncio.gather(*(_on_own_channel(address, build_request(
            f"Only one fits {i}.", seed=i, max_duration_s=1.6)) for i in range(8)))
        ok = [o for o in outcomes if isinstance(o, np.ndarray)]
        refused = [o for o in outcomes if not isinstance(o, np.ndarray)]
        assert ok and refused, outcomes
        for code, details in refused:
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "busy" in details, details
        (rpc,) = cli.pids()[1]
        os.kill(rpc, signal.SIGKILL)
        assert await asyncio.to_thread(cli.proc.wait, 30) == 70, cli.text()[-3000:]
        assert any("RPC process" in r["message"] and "exited" in r["message"] for r in cli.records())
    finally:
        cli.close()


@pytest.mark.parametrize("args,why", [
    (["--rpc-processes", "0"], "--rpc-processes must be at least 1"),
    (["--rpc-processes", "2", "--no-engine-process"], "needs the engine process"),
    (["--rpc-processes", "many"], "--rpc-processes: expected a number or auto, got 'many'"),
])
def test_rpc_processes_mistakes_are_one_line(args, why):
    r = subprocess.run([sys.executable, "-m", "tts_server", "--model", "synthetic-tiny",
                        "--device", "cpu", "--port", "0", "--http-port", "-1", "--metrics-port",
                        "-1", *args], capture_output=True, text=True, timeout=180)
    assert r.returncode == 2 and why in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
