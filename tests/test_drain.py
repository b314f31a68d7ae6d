"""Drain on a real loopback server: during the grace period the listener stays open, health
answers NOT_SERVING and new calls get UNAVAILABLE, in-flight streams finish; then it closes."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tts_client.client import TTSClient, build_request


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="tts.v1.TextToSpeechService"), timeout=5)
        return r.status


async def test_not_serving_is_observable_while_draining(tiny_app):
    from tts_server.config import ServerConfig
    from tts_server.rpc.server import TTSServer

    server = TTSServer(tiny_app.worker, tiny_app.info, ServerConfig(port=0), owns_worker=False)
    await server.start()
    address = f"127.0.0.1:{server.port}"
    assert await _health(address) == health_pb2.HealthCheckResponse.SERVING
    async with TTSClient(address) as client:
        call = client.stream(build_request("Finish me, please.", max_duration_s=4.0, seed=1))
        first = await call.read()  # the stream is in flight
        assert first.HasField("audio")
        stopping = asyncio.ensure_future(server.stop(grace=60.0))
        await asyncio.sleep(0.2)
        assert not stopping.done()
        assert await _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        try:
            await client.synthesize(build_request("Too late.", max_duration_s=0.16), timeout=5)
            raise AssertionError("a new call was accepted while draining")
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.details()
        msgs = [first]
        while (msg := await call.read()) is not grpc.aio.EOF:
            msgs.append(msg)
    assert msgs[-1].HasField("summary") and msgs[-1].summary.num_frames == 50
    await asyncio.wait_for(stopping, 30)
    try:
        await _health(address)
        raise AssertionError("the listener is still open after the drain")
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE


def _ready(port: int) -> int:
    import urllib.error
    import urllib.request

    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5).status
    except urllib.error.HTTPError as e:
        return e.code


async def test_drain_delay_takes_new_calls_while_not_serving(tiny_app):
    """--drain-delay-s: health (gRPC and /ready on the metrics port) turns NOT_SERVING at once,
    but calls are still served for the delay, so a load balancer that polls health has time to
    stop sending before anything is refused."""
    from tts_server.config import ServerConfig
    from tts_server.rpc.server import TTSServer

    cfg = ServerConfig(port=0, metrics_port=0, drain_delay_s=1.5)
    server = TTSServer(tiny_app.worker, tiny_app.info, cfg, owns_worker=False)
    await server.start()
    address = f"127.0.0.1:{server.port}"
    assert await asyncio.to_thread(_ready, server.metrics_port) == 200
    async with TTSClient(address) as client:
        call = client.stream(build_request("Keep the drain busy.", max_duration_s=4.0, seed=2))
        assert (await call.read()).HasField("audio")  # in flight: the listener stays open
        stopping = asyncio.ensure_future(server.stop(grace=10.0))
        await asyncio.sleep(0.1)
        assert await asyncio.to_thread(_ready, server.metrics_port) == 503
        assert await _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        res = await client.synthesize(build_request("Just in time.", max_duration_s=0.4, seed=3), timeout=30)
        assert res.summary.num_frames == 5  # served: within the drain delay
        await asyncio.sleep(1.5)
        try:
            await client.synthesize(build_request("Too late.", max_duration_s=0.16), timeout=5)
            raise AssertionError("a new call was accepted after the drain delay")
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.details()
        last = None
        while (msg := await call.read()) is not grpc.aio.EOF:
            last = msg
        assert last.HasField("summary") and last.summary.num_frames == 50
    await asyncio.wait_for(stopping, 30)
