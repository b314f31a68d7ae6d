"""Replicas behind a real L7 proxy: HAProxy (the distribution's package) with the checked-in
deploy/haproxy/haproxy.cfg in front of three tts-server processes (tiny model, loopback), and a
graceful drain: SIGTERM to one replica while paced streams run on all three -> its health turns
NOT_SERVING first, HAProxy marks it DOWN and sends it nothing new, its streams in flight finish,
no stream fails, and new requests succeed on the other two."""

from __future__ import annotations

import asyncio
import csv
import io
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tts_client.bench import ServerProcess, free_port
from tts_client.client import TTSClient, build_request

pytestmark = pytest.mark.slow

HAPROXY = shutil.which("haproxy") or next(
    (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.path.exists(p)), None)
CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "haproxy" / "haproxy.cfg"
DRAIN_DELAY_S = 3.0  # > the proxy's fall x inter (2 x 0.2 s) with room for a loaded machine: on the
# 2-core CI machine HAProxy marked the replica DOWN 0.3-1.3 s after SIGTERM, and once 2.003 s
STREAM_S = 4.8  # audio per in-flight stream (60 frames), read at real-time pace
NUM_STREAMS = 9

needs_haproxy = pytest.mark.skipif(
    HAPROXY is None, reason="haproxy is not installed (Debian/Ubuntu: apt-get install haproxy; "
                            "`make test` installs it where apt-get works)")


def _stats(sock_path: str) -> dict[tuple[str, str], dict]:
    """HAProxy's `show stat` over its runtime API socket, by (proxy, server)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(sock_path)
        s.sendall(b"show stat\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    rows = csv.DictReader(io.StringIO(data.decode().lstrip("# ")))
    return {(r["pxname"], r["svname"]): r for r in rows}


def _ready(admin_port: int) -> int:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/ready", timeout=2).status
    except urllib.error.HTTPError as e:
        return e.code


def _active_streams(admin_port: int) -> float:
    from tts_client.soak import scrape

    return scrape(f"http://127.0.0.1:{admin_port}/metrics")["tts_active_streams"]


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
    return r.status


async def _paced_stream(client: TTSClient, i: int, started: asyncio.Event | None = None):
    """Reads one stream as a player would (real time after a 0.2 s pre-roll); returns "OK" once
    the summary has come (the stream ended at EOS or at its length), else (status, details)."""
    call = client.stream(build_request(f"Stream number {i} keeps talking.", max_duration_s=STREAM_S,
                                       seed=i))
    got_s, t_first, frames = 0.0, None, 0
    try:
        async for msg in call:
            if msg.HasField("summary"):
                frames = msg.summary.num_frames
                continue
            t_first = t_first or time.monotonic()
            if started is not None:
                started.set()
            got_s += msg.audio.num_samples / msg.audio.sample_rate_hz
            ahead = got_s - 0.2 - (time.monotonic() - t_first)
            if ahead > 0:
                await asyncio.sleep(ahead)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    return "OK" if frames > 0 else ("NO SUMMARY", got_s)


@pytest.fixture
def cluster(tmp_path):
    """Three replicas and HAProxy; everything is stopped at teardown."""
    replicas, env = [], dict(os.environ)
    for n in (1, 2, 3):
        admin = free_port()
        args = ["--device", "cpu", "--metrics-port", str(admin), "--max-buffer-s", "1",
                "--drain-delay-s", str(DRAIN_DELAY_S), "--grace-period-s", "30"]
        r = ServerProcess("synthetic-tiny", "torch", 8, args)  # it picks its HTTP port itself
        http = r.http_port
        r.admin_port = admin
        replicas.append(r)
        env.update({f"TTS_R{n}_HOST": "127.0.0.1", f"TTS_R{n}_GRPC_PORT": str(r.port),
                    f"TTS_R{n}_HTTP_PORT": str(http), f"TTS_R{n}_ADMIN_PORT": str(admin)})
    grpc_port, sock = free_port(), str(tmp_path / "haproxy.sock")
    env.update(TTS_PROXY_HOST="127.0.0.1", TTS_PROXY_GRPC_PORT=str(grpc_port),
               TTS_PROXY_HTTP_PORT=str(free_port()), TTS_HAPROXY_SOCKET=sock,
               TTS_CHECK_INTER="200ms")
    log = open(tmp_path / "haproxy.log", "w")
    proxy = None
    try:
        check = subprocess.run([HAPROXY, "-c", "-f", str(CONFIG)], env=env, capture_output=True,
                               text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        async def all_serving():
            await asyncio.gather(*(r.wait_serving(240) for r in replicas))

        asyncio.run(all_serving())
        proxy = subprocess.Popen([HAPROXY, "-db", "-f", str(CONFIG)], env=env, stdout=log,
                                 stderr=subprocess.STDOUT)
        deadline, st = time.monotonic() + 30, {}
        while True:
            assert proxy.poll() is None, (tmp_path / "haproxy.log").read_text()
            try:
                st = _stats(sock)
                if all(st[("tts_grpc", f"r{n}")]["status"] == "UP" for n in (1, 2, 3)):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "replicas not UP in HAProxy: " + ", ".join(
                f"{k[1]} {v['status']} {v['check_status']}" for k, v in st.items())
            time.sleep(0.1)
        yield f"127.0.0.1:{grpc_port}", replicas, sock
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        log.close()
        for r in replicas:
            r.stop()


@needs_haproxy
def test_sigterm_drains_one_replica_behind_haproxy_without_failing_a_stream(cluster):
    address, replicas, sock = cluster
    victim = replicas[1]  # r2

    async def run():
        async with TTSClient(address) as client:
            for i in range(3):  # through the proxy, before anything happens
                assert await _paced_stream(client, 100 + i) == "OK"
            events = [asyncio.Event() for _ in range(NUM_STREAMS)]
            streams = [asyncio.ensure_future(_paced_stream(client, i, events[i]))
                       for i in range(NUM_STREAMS)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
            in_flight = await asyncio.to_thread(_active_streams, victim.admin_port)
            stot_before = int(_stats(sock)[("tts_grpc", "r2")]["stot"])

            t_term = time.monotonic()
            victim.proc.send_signal(signal.SIGTERM)
            t_not_serving = t_down = None
            while t_down is None:
                if t_not_serving is None and await _health(victim.address) == \
                        health_pb2.HealthCheckResponse.NOT_SERVING:
                    t_not_serving = time.monotonic()
                if _stats(sock)[("tts_grpc", "r2")]["status"].startswith("DOWN"):
                    t_down = time.monotonic()
                assert time.monotonic() - t_term < 10, "HAProxy never marked the replica DOWN"
                await asyncio.sleep(0.02)
            ready_code = await asyncio.to_thread(_ready, victim.admin_port)
            stot_down = int(_stats(sock)[("tts_grpc", "r2")]["stot"])

            # new requests while r2 drains: all go to r1 and r3 and succeed
            fresh = await asyncio.gather(*(_paced_stream(client, 200 + i) for i in range(6)))
            stats = _stats(sock)
            results = await asyncio.gather(*streams)
            return dict(in_flight=in_flight, stot_before=stot_before, stot_down=stot_down,
                        t_not_serving=t_not_serving - t_term, t_down=t_down - t_term,
                        ready_code=ready_code, fresh=fresh, results=results, stats=stats)

    out = asyncio.run(run())
    code = victim.proc.wait(timeout=60)
    log_text = Path(victim.log.name).read_text()
    print(f"drain: {out['in_flight']:.0f} streams in flight on r2 at SIGTERM; NOT_SERVING after "
          f"{out['t_not_serving'] * 1e3:.0f} ms, DOWN in HAProxy after {out['t_down'] * 1e3:.0f} ms; "
          f"{NUM_STREAMS} streams: {out['results']}; 6 new requests: {out['fresh']}; r2 exit {code}")
    assert out["in_flight"] >= 1  # the drain had streams to protect
    assert out["t_not_serving"] <= out["t_down"] < DRAIN_DELAY_S  # health first, then the proxy
    assert out["ready_code"] == 503
    assert out["results"] == ["OK"] * NUM_STREAMS  # every stream finished, on r2 too
    assert out["fresh"] == ["OK"] * 6
    st = out["stats"]
    assert int(st[("tts_grpc", "r2")]["stot"]) == out["stot_down"]  # nothing new reached r2
    assert out["stot_down"] == out["stot_before"]  # not even in the check's window
    assert int(st[("tts_grpc", "BACKEND")]["eresp"]) == 0 and int(st[("tts_grpc", "BACKEND")]["econ"]) == 0
    assert code == 0, log_text[-2000:]
    assert f"health NOT_SERVING; new calls still taken for {DRAIN_DELAY_S:.1f} s" in log_text
