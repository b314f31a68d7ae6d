"""The grpc.aio server: the TTS service, health, reflection, graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tts_client.pb.tts.v1 import tts_pb2, tts_pb2_grpc

from ..config import ServerConfig
from .auth import BearerTokenInterceptor
from .servicer import TextToSpeechServicer

log = logging.getLogger(__name__)

SERVICE_NAME = tts_pb2.DESCRIPTOR.services_by_name["TextToSpeechService"].full_name
MAX_REQUEST_BYTES = 64 * 1024 * 1024  # a 30 s reference WAV at 48 kHz stereo float fits


class TTSServer:
    """Wraps a grpc.aio server around a started engine worker."""

    def __init__(self, worker, info, config: ServerConfig, owns_worker: bool = True):
        self.config = config
        self.worker = worker
        self.owns_worker = owns_worker
        interceptors = [BearerTokenInterceptor(config.auth_token)] if config.auth_token else []
        self.server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
        ])
        tts_pb2_grpc.add_TextToSpeechServiceServicer_to_server(
            TextToSpeechServicer(worker, info, config), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((SERVICE_NAME, reflection.SERVICE_NAME,
                                             health.SERVICE_NAME), self.server)
        address = f"{config.host}:{config.port}"
        if config.tls_cert or config.tls_key:
            if not (config.tls_cert and config.tls_key):
                raise ValueError("TLS needs both --tls-cert and --tls-key")
            with open(config.tls_key, "rb") as k, open(config.tls_cert, "rb") as c:
                creds = grpc.ssl_server_credentials([(k.read(), c.read())])
            self.port = self.server.add_secure_port(address, creds)
        else:
            self.port = self.server.add_insecure_port(address)
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        await self.server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on %s:%d (%s, %s)", SERVICE_NAME, self.config.host, self.port,
                 "TLS" if self.config.tls_cert else "plaintext",
                 "bearer-token auth" if self.config.auth_token else "no auth")

    async def stop(self, grace: float | None = None) -> None:
        """Health goes NOT_SERVING, new calls are refused, in-flight streams get `grace` s."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.config.grace_period_s if grace is None else grace)
        if self.owns_worker:
            await asyncio.to_thread(self.worker.stop, 10.0)

    async def serve_forever(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda s=sig: (
                log.info("%s: draining for up to %.0f s", signal.Signals(s).name,
                         self.config.grace_period_s),
                asyncio.ensure_future(self.stop())))
        await self.start()
        await self.server.wait_for_termination()
        await self.stop()
