"""Shared fixtures: tiny synthetic models (built once per session) and GPU skipping."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_custom():
    """qwen-tts Qwen3TTSModel, CustomVoice-shaped, tiny dims, seeded random weights, fp32."""
    from tts_server.model.synthetic import SYNTHETIC_NAMES, build_synthetic

    return build_synthetic(SYNTHETIC_NAMES["synthetic-tiny"])


@pytest.fixture(scope="session")
def tiny_base():
    """qwen-tts Qwen3TTSModel, Base-shaped (voice cloning), tiny dims, seeded random weights."""
    from tts_server.model.synthetic import SYNTHETIC_NAMES, build_synthetic

    return build_synthetic(SYNTHETIC_NAMES["synthetic-tiny-base"])


@pytest.fixture(scope="session")
def reference_audio():
    """3 s of 24 kHz speech-like test audio (harmonics with a moving pitch plus noise)."""
    import numpy as np

    sr = 24000
    t = np.arange(3 * sr) / sr
    f0 = 120 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    wav = sum(np.sin(k * phase) / k for k in range(1, 8))
    wav = 0.3 * wav / np.abs(wav).max() + 0.01 * np.random.default_rng(0).standard_normal(t.size)
    return wav.astype(np.float32), sr


@pytest.fixture(scope="session")
def tiny_app(tiny_custom):
    """Engine worker + model info for synthetic-tiny (CustomVoice), shared by server tests."""
    from tts_server.app import build_app
    from tts_server.config import ServerConfig
    from tts_server.model.loader import LoadedModel

    import torch

    cfg = ServerConfig(model="synthetic-tiny", engine="torch", max_streams=4, max_queue=0, port=0)
    loaded = LoadedModel("synthetic-tiny", tiny_custom, True, torch.device("cpu"), torch.float32)
    app = build_app(cfg, loaded)
    yield app
    app.worker.stop(10)


@pytest.fixture
async def tiny_server(tiny_app):
    """A real grpc.aio server on 127.0.0.1:<free port> serving the tiny model; yields its address."""
    from tts_server.config import ServerConfig
    from tts_server.rpc.server import TTSServer

    cfg = ServerConfig(model="synthetic-tiny", engine="torch", max_streams=4, port=0)
    server = TTSServer(tiny_app.worker, tiny_app.info, cfg, owns_worker=False)
    await server.start()
    yield f"127.0.0.1:{server.port}"
    await server.stop(grace=1.0)


@pytest.fixture(scope="module")
def base_app(tiny_base):
    """Engine worker + model info for synthetic-tiny-base (Base model: voice cloning), 2 slots."""
    import torch

    from tts_server.app import build_app
    from tts_server.config import ServerConfig
    from tts_server.model.loader import LoadedModel

    loaded = LoadedModel("synthetic-tiny-base", tiny_base, True, torch.device("cpu"), torch.float32)
    app = build_app(ServerConfig(model="synthetic-tiny-base", engine="torch", max_streams=2, port=0), loaded)
    yield app
    app.worker.stop(10)


@pytest.fixture
async def base_server(base_app):
    """A real grpc.aio server on 127.0.0.1:<free port> serving the tiny Base model."""
    from tts_server.config import ServerConfig
    from tts_server.rpc.server import TTSServer

    server = TTSServer(base_app.worker, base_app.info, ServerConfig(port=0), owns_worker=False)
    await server.start()
    yield f"127.0.0.1:{server.port}"
    await server.stop(grace=1.0)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for localhost / 127.0.0.1 -> (cert.pem, key.pem) paths."""
    if not shutil.which("openssl"):
        pytest.skip("openssl is needed to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"),
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"
