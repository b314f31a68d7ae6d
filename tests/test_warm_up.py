"""The start-up's warm-up request (serving/warm_up.py; a GPU server runs it before SERVING): it
goes through the real worker for both model kinds, leaves the next requests' bytes as they were,
and a failure of it is an error, not a silent start."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from tts_server.api import AudioChunk, SamplingConfig, SynthesisRequest
from tts_server.serving import warm_up


def _samples(worker, request) -> np.ndarray:
    async def run():
        handle = worker.submit(request, asyncio.get_running_loop())
        out = []
        async for event in handle:
            if isinstance(event, AudioChunk):
                out.append(event.samples)
                handle.mark_sent(event.samples.shape[0])
        return np.concatenate(out)
    return asyncio.run(run())


def _request(info, i: int) -> SynthesisRequest:
    return SynthesisRequest(request_id=f"r{i}", text="A sentence after the warm-up.", voice=info.default_voice,
                            language="auto", sampling=SamplingConfig(seed=7), max_frames=6,
                            output_sample_rate=info.sample_rate)


def test_warm_up_leaves_the_next_requests_bytes_as_they_were(tiny_app):
    worker, info = tiny_app.worker, tiny_app.info
    before = [_samples(worker, _request(info, i)) for i in range(2)]
    assert warm_up.run_warm_up(worker, info) > 0
    after = [_samples(worker, _request(info, i)) for i in range(2)]
    for a, b in zip(before, after):
        assert a.size > 0 and np.array_equal(a, b)


def test_warm_up_clones_a_voice_on_a_base_model(base_app):
    request = warm_up.warm_up_request(base_app.info)
    assert request.voice is None and request.reference is not None
    assert warm_up.run_warm_up(base_app.worker, base_app.info) > 0


def test_a_failed_warm_up_raises(tiny_custom):
    import torch

    from tts_server.app import build_app
    from tts_server.config import ServerConfig
    from tts_server.model.loader import LoadedModel

    loaded = LoadedModel("synthetic-tiny", tiny_custom, True, torch.device("cpu"), torch.float32)
    app = build_app(ServerConfig(model="synthetic-tiny", engine="torch", max_streams=2, port=0,
                                 inject_fault="stream_error:warm-up@2"), loaded)
    try:
        with pytest.raises(RuntimeError, match="warm-up request failed"):
            warm_up.run_warm_up(app.worker, app.info)
    finally:
        app.worker.stop(10)


def test_a_warm_up_that_does_not_end_in_time_raises_and_frees_its_slot(tiny_app):
    worker = tiny_app.worker
    with pytest.raises(RuntimeError, match="did not end in"):
        warm_up.run_warm_up(worker, tiny_app.info, timeout_s=1e-3)
    for _ in range(100):  # the engine drops the cancelled stream at its next step
        if worker.num_outstanding == 0:
            break
        time.sleep(0.05)
    assert worker.num_outstanding == 0
