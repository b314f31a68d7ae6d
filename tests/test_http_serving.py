"""The HTTP API under the server's production rules, over a real loopback server: bearer auth
and TLS, a hang-up frees the slot, a full queue is 429, draining is visible before the listeners
close, a client that stops reading is paused then cut off, a failed stream is cut, not ended."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import time

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from http_helpers import MODEL, SAMPLES_PER_FRAME, start_server, stop_servers, wait_idle

SPEECH = "/v1/audio/speech"
TOKEN = "s3cret-http-token"
LONG = {"model": MODEL, "input": "A long one.", "response_format": "pcm", "seed": 1,
        "max_duration_s": 60}


@pytest.fixture
async def make_server(tiny_custom):
    started = []

    async def start(**overrides):
        return await start_server(tiny_custom, started, **overrides)

    yield start
    await stop_servers(started)


def _active(app) -> float:
    """tts_active_streams over every engine (the gauge has a device label)."""
    return sum(s.value for family in app.worker.metrics.registry.collect()
               if family.name == "tts_active_streams" for s in family.samples)


async def test_bearer_token_and_tls(make_server, certificate):
    cert, key = certificate
    base, _, app, _ = await make_server(tls_cert=str(cert), tls_key=str(key), auth_token=TOKEN)
    assert base.startswith("https://")
    verify = ssl.create_default_context(cafile=str(cert))
    body = {"model": MODEL, "input": "Secure.", "response_format": "pcm", "seed": 2,
            "max_duration_s": 0.4}
    async with httpx.AsyncClient(base_url=base, verify=verify, timeout=60) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            r = await client.post(SPEECH, json=body, headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert (await client.get("/v1/models", headers=headers)).status_code == 401
        # probes need no token
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/ready")).status_code == 200
    sdk = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0,
                             http_client=httpx.AsyncClient(verify=verify))
    audio = await sdk.audio.speech.create(model=MODEL, voice="ryan", input="Secure.",
                                          response_format="pcm", extra_body={"max_duration_s": 0.4, "seed": 2})
    assert len(audio.content) == 5 * SAMPLES_PER_FRAME * 2
    await sdk.close()
    # plaintext to the TLS port is refused
    async with httpx.AsyncClient(base_url=base.replace("https", "http"), timeout=10) as client:
        with pytest.raises(httpx.HTTPError):
            await client.get("/health")


async def test_client_hang_up_frees_the_slot_within_a_frame(make_server):
    base, _, app, _ = await make_server()
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        for fmt in ("pcm", "mp3"):
            async with client.stream("POST", SPEECH, json=LONG | {"response_format": fmt}) as r:
                assert r.status_code == 200
                async for chunk in r.aiter_raw():
                    if chunk:
                        break
                assert _active(app) == 1
            # leaving the block closes the connection mid-body
            freed_s = await wait_idle(app.worker, timeout=5)
            assert freed_s < 0.5, freed_s  # 80 ms frames, plus a loaded CPU's slack
            assert _active(app) == 0
    engine = app.worker.engine
    assert engine.slots == {} and app.worker.num_free_slots == app.worker.max_streams


async def test_full_queue_is_429_in_openai_shape(make_server):
    base, _, app, _ = await make_server(max_streams=1, max_queue=0)
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        async with client.stream("POST", SPEECH, json=LONG) as held:
            async for chunk in held.aiter_raw():
                if chunk:
                    break
            r = await client.post(SPEECH, json=LONG)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            error = r.json()["error"]
            assert error["type"] == "rate_limit_error" and "busy" in error["message"]
    await wait_idle(app.worker)
    sdk = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    audio = await sdk.audio.speech.create(model=MODEL, voice="ryan", input="Free again.",
                                          response_format="pcm", extra_body={"max_duration_s": 0.4, "seed": 2})
    assert len(audio.content) == 5 * SAMPLES_PER_FRAME * 2
    await sdk.close()


async def test_draining_is_visible_before_the_listeners_close(make_server):
    base, address, app, server = await make_server()
    body = LONG | {"max_duration_s": 2.4}
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        async with client.stream("POST", SPEECH, json=body) as r:
            body_chunks = r.aiter_raw()
            received = bytearray(await anext(body_chunks))
            stopping = asyncio.ensure_future(server.stop(grace=30))
            await asyncio.sleep(0.05)
            # the listeners are still open: probes see the drain, new work is refused
            ready = await client.get("/ready")
            assert ready.status_code == 503 and ready.json()["error"]["code"] == "not_ready"
            refused = await client.post(SPEECH, json=body)
            assert refused.status_code == 503
            async with grpc.aio.insecure_channel(address) as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""))
                assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert not stopping.done()
            async for chunk in body_chunks:  # the stream in flight completes
                received += chunk
        assert len(received) == 30 * SAMPLES_PER_FRAME * 2
        await asyncio.wait_for(stopping, 10)
        with pytest.raises(httpx.ConnectError):
            await client.get("/health")


async def test_client_that_stops_reading_is_paused_then_cut_off(make_server):
    base, _, app, _ = await make_server(max_buffer_s=1.0, stall_timeout_s=4.0)
    worker = app.worker
    # a small receive buffer so that the server's writes block soon (TCP flow control)
    transport = httpx.AsyncHTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)])
    async with httpx.AsyncClient(base_url=base, timeout=60, transport=transport) as slow:
        async with slow.stream("POST", SPEECH, json=LONG | {"response_format": "wav",
                                                             "sample_rate": 48000}) as r:
            assert r.status_code == 200
            deadline = time.monotonic() + 30
            while worker.num_paused == 0:
                assert time.monotonic() < deadline, "the unread stream never paused"
                await asyncio.sleep(0.05)
            stream = next(iter(worker._active.values()))
            frames = stream.num_frames
            await asyncio.sleep(0.5)
            assert stream.num_frames <= frames + 1  # paused: not generating
            assert frames * 0.08 < 20  # it stopped after seconds of audio, not 60
            # cut off after stall_timeout_s without progress: the slot is free
            assert await wait_idle(worker, timeout=15) < 15
            with pytest.raises(httpx.RemoteProtocolError):  # the body was cut, not ended
                async for _ in r.aiter_raw():
                    pass
    assert worker.metrics.registry.get_sample_value(
        "tts_requests_total", {"code": "RESOURCE_EXHAUSTED"}) == 1


async def test_stream_failing_midway_is_cut_not_ended(make_server):
    base, _, app, _ = await make_server(inject_fault="stream_error:bad-1@3,stream_error:bad-2@3")
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        body = LONG | {"max_duration_s": 2.4}
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream("POST", SPEECH, json=body,
                                     headers={"x-request-id": "bad-1"}) as r:
                assert r.status_code == 200
                async for _ in r.aiter_raw():
                    pass
        events = []
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream("POST", SPEECH, json=body | {"stream_format": "sse"},
                                     headers={"x-request-id": "bad-2"}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(json.loads(line[6:]))
        assert events[-1]["type"] == "error" and "non-finite" in events[-1]["error"]["message"]
        assert {e["type"] for e in events[:-1]} <= {"speech.audio.delta"}
        ok = await client.post(SPEECH, json=body | {"max_duration_s": 0.4})
        assert ok.status_code == 200 and len(ok.content) == 5 * SAMPLES_PER_FRAME * 2
    await wait_idle(app.worker)


async def test_body_over_max_request_bytes_is_413(make_server):
    base, _, app, _ = await make_server(max_request_bytes=4096)
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        r = await client.post(SPEECH, json=LONG | {"ref_audio": "A" * 8192})
        assert r.status_code == 413
        error = r.json()["error"]
        assert error["code"] == "request_too_large" and error["param"] == "body"
        ok = await client.post(SPEECH, json=LONG | {"max_duration_s": 0.4})
        assert ok.status_code == 200
    assert app.worker.metrics.registry.get_sample_value(
        "tts_requests_total", {"code": "RESOURCE_EXHAUSTED"}) == 1


async def test_http_port_in_use_fails_start_up_with_one_line(make_server):
    from tts_server.memory_plan import StartupError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(StartupError, match=f"--http-port {port}: cannot listen"):
            await make_server(http_port=port)
