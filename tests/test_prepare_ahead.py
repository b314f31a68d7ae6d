"""While the device runs a step, the engine loop builds waiting requests' prompts (engine.run's
on_wait, `_prepare_ahead`); their admission then skips that work. Over a real loopback server
(tiny model, CPU): the same audio, byte for byte, as prompts built at admission."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tts_client.client import TTSClient, build_request

pytestmark = pytest.mark.slow

CFG = dict(model="synthetic-tiny", engine="torch", port=0, max_streams=2, max_queue=8)
TEXTS = ["A different sentence with other words.", "Short one.", "Numbers: one, two, three.",
         "Yet another voice line.", "The quick brown fox.", "Hello there, again?"]


class BusyDevice:
    """The CPU torch engine posing as one whose device is still busy when run() would wait
    (on the CPU the work is done by then, so the batched engine's busy() is always False)."""

    waits_for_device = True

    def __init__(self, inner):
        self.inner = inner
        self.waits = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, plan, on_codes=None, on_wait=None):
        if on_wait is not None:
            self.waits += 1
            on_wait(lambda: True)
        return self.inner.run(plan, on_codes)


async def _all(address, seed0):
    async def one(i, text):
        async with TTSClient(address) as client:
            res = await client.synthesize(build_request(text, seed=seed0 + i, max_duration_s=0.8,
                                                        sample_rate_hz=16000 if i % 2 else 0), timeout=120)
        return res.samples

    return await asyncio.gather(*(one(i, t) for i, t in enumerate(TEXTS)))


async def test_prompts_built_ahead_give_the_same_audio(tiny_custom):
    import torch

    from tts_server.app import build_app
    from tts_server.config import ServerConfig
    from tts_server.model.loader import LoadedModel
    from tts_server.rpc.server import TTSServer

    loaded = LoadedModel("synthetic-tiny", tiny_custom, True, torch.device("cpu"), torch.float32)
    app = build_app(ServerConfig(**CFG), loaded)
    worker = app.worker
    assert not worker._ahead  # the torch engine never waits for a device
    busy = BusyDevice(worker.engine)
    srv = TTSServer(worker, app.info, ServerConfig(**CFG), owns_worker=False)
    await srv.start()
    try:
        address = f"127.0.0.1:{srv.port}"
        at_admission = await _all(address, 10)  # 6 requests for 2 slots: 4 wait each time
        assert worker.prepared_ahead == 0
        worker.engine, worker._ahead = busy, True
        ahead = await _all(address, 10)
        assert busy.waits > 0 and worker.prepared_ahead >= 3, (busy.waits, worker.prepared_ahead)
        for a, b in zip(at_admission, ahead):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    finally:
        await srv.stop(grace=0.5)
        worker.stop(10.0)
