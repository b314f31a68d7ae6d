"""The same request and seed give byte-identical audio alone and among other streams, over a real
loopback server (tiny model): at the native rate and at a resampled one, greedy and sampled."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from tts_client.client import TTSClient, build_request

pytestmark = pytest.mark.slow

OTHERS = ["A different sentence with other words.", "Short one.",
          "Numbers: one, two, three, four, five.", "Yet another voice line for the crowd.",
          "The quick brown fox jumps over the lazy dog.", "Hello?", "Seven streams at once."]


CFG = dict(model="synthetic-tiny", engine="torch", port=0, max_streams=8, max_queue=8)


@pytest.fixture(scope="module")
def app8(tiny_custom):
    import torch

    from tts_server.app import build_app
    from tts_server.config import ServerConfig
    from tts_server.model.loader import LoadedModel

    loaded = LoadedModel("synthetic-tiny", tiny_custom, True, torch.device("cpu"), torch.float32)
    app = build_app(ServerConfig(**CFG), loaded)
    yield app
    app.worker.stop(10.0)


@pytest.fixture
async def server(app8):
    from tts_server.config import ServerConfig
    from tts_server.rpc.server import TTSServer

    srv = TTSServer(app8.worker, app8.info, ServerConfig(**CFG), owns_worker=False)
    await srv.start()
    yield f"127.0.0.1:{srv.port}", app8
    await srv.stop(grace=0.5)


async def _audio(address, request):
    async with TTSClient(address) as client:
        res = await client.synthesize(request, timeout=120)
    return res.samples, len(res.chunk_times_s)


async def _among_others(address, request, num_others, rng):
    """`request` started at a random moment among `num_others` other streams."""
    others = [build_request(text, seed=rng.randrange(1000), max_duration_s=rng.choice([0.8, 1.6, 2.4]),
                            sample_rate_hz=rng.choice([0, 16000, 8000]))
              for text in rng.sample(OTHERS, num_others)]
    tasks = [asyncio.create_task(_audio(address, r)) for r in others]
    await asyncio.sleep(rng.uniform(0.0, 0.3))
    mine = await _audio(address, request)
    await asyncio.gather(*tasks)
    return mine


@pytest.mark.parametrize("rate,greedy", [(0, False), (16000, False), (22050, True)])
async def test_same_request_same_bytes_alone_and_under_load(server, rate, greedy):
    address, _ = server
    request = build_request("The same words, the same seed, the same audio.", seed=1234,
                            greedy=greedy, max_duration_s=2.0, sample_rate_hz=rate)
    alone, _ = await _audio(address, request)
    assert alone.size > 0
    rng = random.Random(rate + greedy)
    for num_others in (3, 7):
        crowded, _ = await _among_others(address, request, num_others, rng)
        assert crowded.shape == alone.shape
        assert np.array_equal(crowded, alone), (
            f"{np.count_nonzero(crowded != alone)} samples differ among {num_others} others")


async def test_a_different_seed_gives_different_audio(server):
    address, _ = server
    a, _ = await _audio(address, build_request("Seeds matter.", seed=1, max_duration_s=1.0))
    b, _ = await _audio(address, build_request("Seeds matter.", seed=2, max_duration_s=1.0))
    assert not (a.shape == b.shape and np.array_equal(a, b))
