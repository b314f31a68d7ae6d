"""`--devices`: the placement rules, the pool's admission policy over fake engines, and a real
loopback server with two CPU engines (tiny model) where injected device faults kill one engine
and then the other."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tts_client.client import TTSClient, build_request
from tts_server.api import EngineFailure, Overloaded, ShuttingDown
from tts_server.devices import Placement, resolve_placements
from tts_server.memory_plan import StartupError
from tts_server.serving.pool import EnginePool, admission_order


# ---- placements ----------------------------------------------------------------------------
@pytest.mark.parametrize("device,devices,gpus,expected", [
    ("auto", None, 0, [Placement("cpu", "cpu")]),
    ("auto", None, 2, [Placement("cuda", "cuda")]),
    ("cuda:1", None, 2, [Placement("cuda:1", "cuda:1")]),
    ("auto", "all", 3, [Placement(f"cuda:{i}", f"cuda:{i}") for i in range(3)]),
    ("cuda", "1, 0", 2, [Placement("cuda:1", "cuda:1"), Placement("cuda:0", "cuda:0")]),
    ("cpu", "0,1", 0, [Placement("cpu", "cpu:0"), Placement("cpu", "cpu:1")]),
])
def test_placements(device, devices, gpus, expected):
    assert resolve_placements(device, devices, gpus) == expected


@pytest.mark.parametrize("device,devices,gpus,message", [
    ("auto", "0,2", 2, "GPU 2 does not exist (2 visible: 0..1)"),
    ("cuda", "0", 0, "no GPU is visible"),
    ("cpu", "all", 0, "--devices all needs GPUs"),
    ("auto", "0,0", 2, "each GPU number once"),
    ("auto", "one", 2, "expected 'all' or GPU numbers"),
    ("auto", " , ", 2, "--devices is empty"),
    ("cuda:1", "0,1", 2, "give --devices alone"),
])
def test_placement_errors_say_what_is_wrong(device, devices, gpus, message):
    with pytest.raises(StartupError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_placements(device, devices, gpus)


# ---- the admission policy ------------------------------------------------------------------
def test_admission_order_prefers_a_free_slot_then_the_lightest_load():
    # (outstanding, slots, alive)
    assert admission_order([(0, 4, True), (0, 4, True)]) == [0, 1]
    assert admission_order([(2, 4, True), (1, 4, True)]) == [1, 0]
    assert admission_order([(3, 8, True), (2, 4, True)]) == [0, 1]  # 3/8 < 2/4
    assert admission_order([(4, 4, True), (7, 8, True)]) == [1, 0]  # only engine 1 has a free slot
    assert admission_order([(6, 4, True), (10, 8, True)]) == [1, 0]  # both queue: 10/8 < 6/4
    assert admission_order([(0, 4, False), (3, 4, True)]) == [1]  # a dead engine takes nothing


class FakeWorker:
    """The Worker interface the pool uses: enqueue (a caller's handle) with the real refusals,
    fatal listeners."""

    def __init__(self, label, slots, queue=0):
        self.label, self.max_streams, self.max_queue = label, slots, queue
        self.metrics = object()
        self.failure = None
        self.num_outstanding = self.num_active = self.num_paused = 0
        self.num_free_slots = slots
        self.watchdog_tick = None
        self.stopping = False
        self.listeners = []

    def add_fatal_listener(self, fn):
        self.listeners.append(fn)

    def enqueue(self, handle):
        if self.failure is not None:
            raise EngineFailure("dead")
        if self.stopping:
            raise ShuttingDown("stopping")
        if self.num_outstanding >= self.max_streams + self.max_queue:
            raise Overloaded("full")
        self.num_outstanding += 1
        return (self.label, handle.request)

    def fail(self, why):
        self.failure = EngineFailure(why)
        for fn in self.listeners:
            fn(self.failure)


def test_pool_spreads_requests_and_loses_only_the_failed_engines_capacity():
    a, b = FakeWorker("cuda:0", 2, queue=1), FakeWorker("cuda:1", 2, queue=1)
    pool = EnginePool([a, b])
    fatal = []
    pool.add_fatal_listener(fatal.append)
    assert [pool.submit(i, None)[0] for i in range(4)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert pool.max_streams == 4 and pool.num_outstanding == 4
    assert [pool.submit(i, None)[0] for i in range(2)] == ["cuda:0", "cuda:1"]  # into the queues
    with pytest.raises(Overloaded, match="all 4 synthesis streams on 2 engines are busy"):
        pool.submit("one too many", None)
    a.fail("CUDA error: injected")
    assert pool.max_streams == 2 and pool.failure is None and not fatal
    b.num_outstanding = 0
    assert pool.submit("after", None)[0] == "cuda:1"  # the live engine takes it
    b.fail("hung")
    assert pool.failure is not None and fatal == [pool.failure] and pool.max_streams == 0
    with pytest.raises(EngineFailure, match="every decode engine has failed"):
        pool.submit("nobody home", None)


def test_pool_with_every_engine_dead_refuses_before_it_has_heard_of_it():
    a, b = FakeWorker("cuda:0", 1), FakeWorker("cuda:1", 1)
    pool = EnginePool([a, b])
    a.failure = b.failure = EngineFailure("hung")  # the listeners have not run yet
    with pytest.raises(EngineFailure, match="every decode engine has failed"):
        pool.submit("now", None)


def test_pool_refuses_while_shutting_down():
    a, b = FakeWorker("cpu:0", 1), FakeWorker("cpu:1", 1)
    a.stopping = b.stopping = True
    with pytest.raises(ShuttingDown):
        EnginePool([a, b]).submit("late", None)


# ---- a real server with two CPU engines ----------------------------------------------------
def _scrape(port) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def _outcome(client, request):
    try:
        res = await client.synthesize(request, timeout=60)
        return res.summary.num_frames
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()


async def _health(address) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
    return r.status


@pytest.fixture
async def two_engine_server(tiny_custom):
    import torch

    from tts_server.app import build_app
    from tts_server.config import ServerConfig
    from tts_server.model.loader import LoadedModel
    from tts_server.rpc.server import TTSServer

    cfg = ServerConfig(model="synthetic-tiny", engine="torch", device="cpu", devices="0,1",
                       max_streams=2, max_queue=0, max_buffer_s=0.5, port=0, metrics_port=0,
                       inject_fault="device_error:kill-1@2,device_error:kill-0@2")
    loaded = LoadedModel("synthetic-tiny", tiny_custom, True, torch.device("cpu"), torch.float32)
    app = await asyncio.to_thread(build_app, cfg, loaded)
    server = TTSServer(app.worker, app.info, cfg, owns_worker=False)
    await server.start()
    yield f"127.0.0.1:{server.port}", app, server
    await server.stop(grace=0.5)
    await asyncio.to_thread(app.worker.stop, 10.0)


async def test_two_engines_share_load_and_a_failed_engine_ends_only_its_streams(two_engine_server):
    address, app, server = two_engine_server
    pool = app.worker
    e0, e1 = pool.workers
    assert isinstance(pool, EnginePool) and (e0.label, e1.label) == ("cpu:0", "cpu:1")
    assert app.info.device == "cpu:0,cpu:1"
    async with TTSClient(address) as client:
        info = await client.model_info()
        assert info.max_concurrent_streams == 4 and info.device == "cpu:0,cpu:1"
        # least-loaded admission: four long streams take both engines' two slots each
        long = [client.stream(build_request(f"Long {i}.", max_duration_s=60, seed=i))
                for i in range(4)]
        for call in long:
            assert (await call.read()).HasField("audio")
        assert (e0.num_active, e1.num_active) == (2, 2)
        for call in long:
            call.cancel()
        await _until(lambda: pool.num_outstanding == 0)

        # a bystander on cpu:0 (its client reads nothing for now: the stream pauses after 0.5 s
        # of unsent audio, so it surely still holds its slot), then a request that faults
        # cpu:1's device at its second frame
        slow = TTSClient(address, options=[("grpc.http2.bdp_probe", 0)])
        bystander = slow.stream(build_request("A bystander.", max_duration_s=6.0, seed=1,
                                              request_id="bystander"))
        assert (await bystander.read()).HasField("audio")
        assert (e0.num_active, e1.num_active) == (1, 0)
        killed = await _outcome(client, build_request("Boom.", max_duration_s=30, seed=2,
                                                        request_id="kill-1"))
        assert killed[0] == grpc.StatusCode.UNAVAILABLE and "illegal memory access" in killed[1]
        assert e1.failure is not None and e0.failure is None and pool.failure is None
        summary = None
        while (msg := await bystander.read()) is not grpc.aio.EOF:  # it runs to its end
            summary = msg.summary if msg.HasField("summary") else summary
        assert summary is not None and summary.num_frames == 75
        await slow.close()
        assert await _health(address) == health_pb2.HealthCheckResponse.SERVING
        assert (await client.model_info()).max_concurrent_streams == 2
        assert await _outcome(client, build_request("Still here.", max_duration_s=0.4, seed=3)) == 5
        m = await asyncio.to_thread(_scrape, server.metrics_port)
        assert m[("tts_engine_healthy", (("device", "cpu:0"),))] == 1
        assert m[("tts_engine_healthy", (("device", "cpu:1"),))] == 0
        assert m[("tts_stream_slots", (("device", "cpu:0"),))] == 2
        assert m[("tts_stream_slots", (("device", "cpu:1"),))] == 0
        assert m[("tts_frames_total", (("device", "cpu:0"),))] >= 80
        assert m[("tts_requests_total", (("code", "UNAVAILABLE"),))] == 1

        # the last engine fails too: now health is NOT_SERVING and the server reports failure
        last = await _outcome(client, build_request("Boom again.", max_duration_s=30, seed=4,
                                                    request_id="kill-0"))
        assert last[0] == grpc.StatusCode.UNAVAILABLE
        await _until(lambda: server.failure is not None)
        after = await _outcome(client, build_request("Anyone?", max_duration_s=0.16))
        assert after[0] == grpc.StatusCode.UNAVAILABLE and "every decode engine" in after[1]
    assert await _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING


async def _until(predicate, timeout=20.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


# ---- two real GPUs ------------------------------------------------------------------------
@pytest.mark.gpu
def test_graphs_capture_on_a_second_gpu_after_one_on_the_first():
    """torch.cuda.graph's default capture stream is made once, on the GPU current at the first
    capture; an engine on a second GPU that captured on it failed at start-up (--devices 0,1 on
    an H200 x2, 2026-11-27). The captures here pass a stream of their own device."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from tts_server.engines.batched.prefill import capture

    outs, before = {}, torch.cuda.current_device()
    try:
        for index in (0, 1):
            dev = torch.device("cuda", index)
            torch.cuda.set_device(dev)  # as build_worker does for each engine
            x = torch.zeros(4, device=dev)
            graphs = capture(lambda n, x=x: x[:n].add_(1), [2, 4], dev)
            graphs[4].replay()
            torch.cuda.synchronize(dev)
            outs[index] = x.tolist()
    finally:
        torch.cuda.set_device(before)
    # the warm-up ran n = 2 and n = 4 once each; the replay of n = 4 adds one more
    assert outs == {0: [3.0, 3.0, 2.0, 2.0], 1: [3.0, 3.0, 2.0, 2.0]}, outs
