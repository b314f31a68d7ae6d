"""TTSClient(channels=N): calls take N connections in turn (so that a server's RPC processes,
each holding whole connections, share a client's streams), checked by the peers a gRPC server
sees; and the same through the real loopback server."""

from __future__ import annotations

import grpc
import pytest

from tts_client.client import TTSClient, build_request
from tts_client.pb.tts.v1 import tts_pb2, tts_pb2_grpc


class _Peers(tts_pb2_grpc.TextToSpeechServiceServicer):
    """Records each Synthesize call's peer (the client's address and port: its connection)."""

    def __init__(self):
        self.peers: list[str] = []

    async def Synthesize(self, request, context):
        self.peers.append(context.peer())
        yield tts_pb2.SynthesizeResponse(summary=tts_pb2.SynthesisSummary(request_id=request.request_id))


@pytest.fixture
async def peers_server():
    server = grpc.aio.server()
    servicer = _Peers()
    tts_pb2_grpc.add_TextToSpeechServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}", servicer
    await server.stop(None)


async def _calls(client, n):
    for i in range(n):
        [m async for m in client.chunks(build_request("Hi.", request_id=f"r{i}"), timeout=10)]


async def test_calls_take_the_channels_in_turn_each_its_own_connection(peers_server):
    address, servicer = peers_server
    async with TTSClient(address, channels=3) as client:
        await _calls(client, 6)
    assert len(set(servicer.peers)) == 3
    assert servicer.peers[:3] == servicer.peers[3:]  # in turn
    servicer.peers.clear()
    async with TTSClient(address) as client:  # the default: one connection
        await _calls(client, 3)
    assert len(set(servicer.peers)) == 1


def test_channels_below_one_are_refused():
    with pytest.raises(ValueError, match="channels must be at least 1"):
        TTSClient("127.0.0.1:1", channels=0)


async def test_a_pooled_client_streams_from_the_real_server(tiny_server):
    async with TTSClient(tiny_server, channels=2) as client:
        results = [await client.synthesize(build_request("Two channels.", seed=3, max_duration_s=0.4),
                                           timeout=60) for _ in range(2)]
    assert results[0].samples.size and (results[0].samples == results[1].samples).all()


async def test_each_pipecat_service_gets_a_connection_of_its_own(peers_server):
    """Two QwenTTSService channels (one per voice call in an agent process) are two connections,
    so that the calls spread over a server's RPC processes."""
    from pipecat_service import QwenTTSService

    address, servicer = peers_server
    clients = [TTSClient(address, options=list(QwenTTSService.CHANNEL_OPTIONS)) for _ in range(2)]
    try:
        for c in clients:
            await _calls(c, 1)
    finally:
        for c in clients:
            await c.close()
    assert len(set(servicer.peers)) == 2


@pytest.mark.parametrize("connections,want", [(0, 4), (1, 1), (2, 2)])
async def test_bench_closed_loop_clients_share_the_given_connections(peers_server, connections, want):
    """tts-bench --connections N: the level's clients share N connections (1: as a client with one
    channel, whose calls all reach one of a server's RPC processes); 0: one per client."""
    from tts_client import bench

    address, servicer = peers_server
    a = bench.parse_args(["--connections", str(connections), "--requests", "8"])
    items = bench.schedule(bench.WORKLOADS[a.workload], 8, a.seed, 0.4)
    records = await bench.run_level(address, items, 4, a, "", 12.5, None)
    assert len(records) == 8 and len(servicer.peers) == 8
    assert len(set(servicer.peers)) == want, servicer.peers
