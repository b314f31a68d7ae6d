"""Shared pieces of the HTTP API tests: a loopback server factory (gRPC + HTTP on free ports,
tiny synthetic model, torch engine) and audio decoding with real decoders."""

from __future__ import annotations

import asyncio
import io
import time

import av
import numpy as np
import soundfile

MODEL = "synthetic-tiny"
SAMPLES_PER_FRAME = 1920  # at the model's 24 kHz


async def start_server(tts_model, started: list, name: str = MODEL, **overrides):
    """A TTSServer for the qwen-tts model `tts_model` (named `name`) with its own worker and the
    HTTP API on a free port; returns (http base URL, gRPC address, app, server)."""
    import torch

    from tts_server.app import build_app
    from tts_server.config import ServerConfig
    from tts_server.model.loader import LoadedModel
    from tts_server.rpc.server import TTSServer

    cfg = ServerConfig(**(dict(model=name, engine="torch", port=0, http_port=0, max_streams=2)
                          | overrides))
    loaded = LoadedModel(name, tts_model, True, torch.device("cpu"), torch.float32)
    app = await asyncio.to_thread(build_app, cfg, loaded)
    server = TTSServer(app.worker, app.info, cfg, owns_worker=False)
    started.append((app, server))  # stopped at teardown even if it fails to start
    await server.start()
    scheme = "https" if cfg.tls_cert else "http"
    return f"{scheme}://127.0.0.1:{server.http_port}", f"127.0.0.1:{server.port}", app, server


async def stop_servers(started: list) -> None:
    from tts_server.testing.faults import FaultInjectingEngine

    for app, server in started:
        await server.stop(grace=0.5)
        if isinstance(app.worker.engine, FaultInjectingEngine):
            app.worker.engine.released.set()
        await asyncio.to_thread(app.worker.stop, 10.0)


async def wait_idle(worker, timeout=10.0) -> float:
    """Seconds until the worker has no stream left (asserts it gets there within `timeout`)."""
    t0 = time.monotonic()
    while worker.num_outstanding or worker.num_active:
        assert time.monotonic() - t0 < timeout, f"{worker.num_outstanding} streams left"
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


def pcm_samples(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def decode(data: bytes, fmt: str, rate: int) -> tuple[np.ndarray, int]:
    """(float32 samples, sample rate) decoded by soundfile (WAV) or FFmpeg through PyAV."""
    if fmt == "pcm":
        return pcm_samples(data), rate
    if fmt == "wav":
        samples, sr = soundfile.read(io.BytesIO(data), dtype="float32")
        return samples, sr
    options = {"sample_rate": str(rate)} if fmt in ("mulaw", "alaw") else {}
    with av.open(io.BytesIO(data), format=fmt if fmt in ("mulaw", "alaw") else None,
                 options=options) as container:
        stream = container.streams.audio[0]
        out = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(stream)])
        if out.dtype.kind == "i":
            out = out.astype(np.float32) / float(np.iinfo(out.dtype).max + 1)
        return out.astype(np.float32), stream.rate
