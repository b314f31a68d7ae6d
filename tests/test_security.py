"""TLS and bearer-token auth over loopback: UNAUTHENTICATED without the token, health stays open."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tts_client.client import TTSClient, build_request

TOKEN = "s3cret-token"


@pytest.fixture
async def secure_server(tiny_app, certificate):
    from tts_server.config import ServerConfig
    from tts_server.rpc.server import TTSServer

    cert, key = certificate
    cfg = ServerConfig(port=0, tls_cert=str(cert), tls_key=str(key), auth_token=TOKEN)
    server = TTSServer(tiny_app.worker, tiny_app.info, cfg, owns_worker=False)
    await server.start()
    yield f"localhost:{server.port}", cert.read_bytes()
    await server.stop(grace=1.0)


def _client(address, ca, token=None):
    md = (("authorization", f"Bearer {token}"),) if token else ()
    return TTSClient(address, credentials=grpc.ssl_channel_credentials(ca), metadata=md)


async def test_token_required_and_accepted(secure_server):
    address, ca = secure_server
    for token in (None, "wrong"):
        async with _client(address, ca, token) as client:
            for call in (client.model_info(), client.synthesize(build_request("hi", max_duration_s=0.16))):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with _client(address, ca, TOKEN) as client:
        res = await client.synthesize(build_request("Authorised.", max_duration_s=0.16, seed=1))
    assert res.summary.num_frames == 2


async def test_health_needs_no_token_and_plaintext_is_refused(secure_server):
    address, ca = secure_server
    async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca)) as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
        assert r.status == health_pb2.HealthCheckResponse.SERVING
    async with TTSClient(address, metadata=(("authorization", f"Bearer {TOKEN}"),)) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.model_info(timeout=3)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def _run_cli(*args, env=None):
    """The CLI in a subprocess, awaited so this loop keeps serving the in-process server."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "tts_client.cli", *args,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                env=env)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode(), err.decode()


async def test_cli_with_token_and_ca(secure_server, tmp_path):
    address, ca = secure_server
    (tmp_path / "ca.pem").write_bytes(ca)
    base = ["--address", address, "--tls-ca", str(tmp_path / "ca.pem")]
    rc, out, err = await _run_cli(*base, "--token", TOKEN, "voices")
    assert rc == 0, err
    assert "aiden (default)" in out
    env = {k: v for k, v in os.environ.items() if k != "TTS_AUTH_TOKEN"}
    rc, out, err = await _run_cli(*base, "voices", env=env)
    assert rc == 1 and "UNAUTHENTICATED" in err


async def test_bearer_scheme_is_case_insensitive(secure_server):
    address, ca = secure_server
    for value, ok in ((f"bearer {TOKEN}", True), (f"BEARER  {TOKEN}", True),
                      (f"Basic {TOKEN}", False), (TOKEN, False), (f"Bearer {TOKEN}x", False)):
        async with TTSClient(address, credentials=grpc.ssl_channel_credentials(ca),
                             metadata=(("authorization", value),)) as client:
            if ok:
                assert (await client.model_info()).model
            else:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.model_info()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, value


async def test_plaintext_cli_against_tls_server_gets_a_hint(secure_server):
    address, _ = secure_server
    rc, out, err = await _run_cli("--address", address, "--token", TOKEN, "voices")
    assert rc == 1 and err.startswith("error: UNAVAILABLE")
    assert "hint:" in err and "If it serves TLS, pass --tls-ca" in err
