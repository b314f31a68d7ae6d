"""TTS_STEP_TRACE=<path>: the engine thread appends one JSON line per step (the benchmark scripts'
view of admissions, step times and the players' lead), over a real loopback server."""

from __future__ import annotations

import json

import pytest

from tts_client.client import TTSClient, build_request

pytestmark = pytest.mark.slow

CFG = dict(model="synthetic-tiny", engine="torch", port=0, max_streams=2, max_queue=2)


async def test_step_trace_lines(tiny_custom, tmp_path, monkeypatch):
    import torch

    from tts_server.app import build_app
    from tts_server.config import ServerConfig
    from tts_server.model.loader import LoadedModel
    from tts_server.rpc.server import TTSServer

    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("TTS_STEP_TRACE", str(path))
    loaded = LoadedModel("synthetic-tiny", tiny_custom, True, torch.device("cpu"), torch.float32)
    app = build_app(ServerConfig(**CFG), loaded)
    srv = TTSServer(app.worker, app.info, ServerConfig(**CFG), owns_worker=False)
    await srv.start()
    try:
        async with TTSClient(f"127.0.0.1:{srv.port}") as client:
            res = await client.synthesize(build_request("Trace this.", seed=1, max_duration_s=0.4), timeout=60)
    finally:
        await srv.stop(grace=0.5)
        app.worker.stop(10)
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    assert sum(s["admit"] for s in steps) == 1
    assert steps[0]["admit"] == 1 and steps[0]["prefill_s"] > 0
    frames = sum(s["step"] for s in steps) + 1  # the admission makes the first frame in its step
    assert frames == res.summary.num_frames
    assert all(s["dt"] > 0 and s["decode_s"] >= 0 and s["codec_s"] >= 0 for s in steps)
    assert all(s["min_lead"] is None or s["min_lead"] > -1 for s in steps)

