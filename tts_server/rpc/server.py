"""The grpc.aio server: the TTS service, health, reflection, graceful shutdown; and beside it,
in the same event loop and on the same worker, the OpenAI-compatible HTTP API (`--http-port`)."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tts_client.pb.tts.v1 import tts_pb2

from ..config import ServerConfig
from ..memory_plan import StartupError
from . import convert
from .auth import BearerTokenInterceptor
from .servicer import TextToSpeechServicer

log = logging.getLogger(__name__)

SERVICE_NAME = tts_pb2.DESCRIPTOR.services_by_name["TextToSpeechService"].full_name
EXIT_ENGINE_FAILURE = 70  # EX_SOFTWARE: the engine hung or faulted; restart the process


def add_servicer(servicer: TextToSpeechServicer, server) -> None:
    """As the generated add_TextToSpeechServiceServicer_to_server, but the request
    deserializers of Synthesize and StreamSynthesize never raise: bytes that are not a SynthesizeRequest (invalid UTF-8 in a
    string field, say) reach the handler, which answers INVALID_ARGUMENT naming the field."""
    handlers = {
        "Synthesize": grpc.unary_stream_rpc_method_handler(
            servicer.Synthesize, request_deserializer=convert.parse_synthesize_request,
            response_serializer=tts_pb2.SynthesizeResponse.SerializeToString),
        "StreamSynthesize": grpc.stream_stream_rpc_method_handler(
            servicer.StreamSynthesize, request_deserializer=convert.parse_stream_request,
            response_serializer=tts_pb2.StreamSynthesizeResponse.SerializeToString),
        "ListVoices": grpc.unary_unary_rpc_method_handler(
            servicer.ListVoices, request_deserializer=tts_pb2.ListVoicesRequest.FromString,
            response_serializer=tts_pb2.ListVoicesResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo, request_deserializer=tts_pb2.GetModelInfoRequest.FromString,
            response_serializer=tts_pb2.GetModelInfoResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class TTSServer:
    """Wraps a grpc.aio server around a started engine worker."""

    def __init__(self, worker, info, config: ServerConfig, owns_worker: bool = True):
        self.config = config
        self.worker = worker
        self.owns_worker = owns_worker
        interceptors = [BearerTokenInterceptor(config.auth_token)] if config.auth_token else []
        self.server = grpc.aio.server(interceptors=interceptors, options=[
            # one listener per port, unless several RPC processes share it (--rpc-processes)
            ("grpc.so_reuseport", 1 if config.several_rpc_processes else 0),
            ("grpc.max_receive_message_length", config.max_request_bytes),
        ])
        self.servicer = TextToSpeechServicer(worker, info, config)
        add_servicer(self.servicer, self.server)
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
        try:
            self.port = (self.server.add_secure_port(address, creds) if config.tls_cert
                         else self.server.add_insecure_port(address))
        except RuntimeError:  # grpc says only "Failed to bind"; preflight.check_port says why
            raise StartupError(f"--host {config.host} --port {config.port}: cannot listen there "
                               f"(port in use?)") from None
        self._stopped = asyncio.Event()
        self.is_ready = False  # what health says (SERVING), also served as /ready on the metrics port
        self.failure = None  # the EngineFailure that ended serving, if any
        self._failed = asyncio.Event()
        self.metrics_port: int | None = None
        self.http = None
        self.http_port: int | None = None
        if config.http_port is not None and config.http_port >= 0:
            try:
                from ..http.server import HTTPServer
            except ImportError as e:
                raise StartupError(f"--http-port {config.http_port}: the HTTP API needs {e.name} "
                                   "(pip install -e '.[server]'), or --http-port -1 to run "
                                   "without it") from None
            self.http = HTTPServer(worker, info, config, ready=lambda: self.is_ready,
                                   accepting=self.accepting)

    def accepting(self) -> bool:
        """New speech requests are taken: not past the drain delay, the engine not failed."""
        return (not self.servicer.draining and self.failure is None
                and self.worker.failure is None)

    async def start(self) -> None:
        await self.server.start()
        if self.http is not None:
            try:
                self.http_port = await self.http.start(self.config.http_port)
            except OSError as e:
                await self.server.stop(None)
                raise StartupError(f"--http-port {self.config.http_port}: cannot listen on "
                                   f"{self.config.host} ({e.strerror or e}); choose another port "
                                   "or -1 to turn the HTTP API off") from None
        loop = asyncio.get_running_loop()
        self.worker.add_fatal_listener(
            lambda failure: loop.call_soon_threadsafe(self._on_engine_failure, failure))
        if self.worker.failure is not None:
            self._on_engine_failure(self.worker.failure)
        else:
            for name in ("", SERVICE_NAME):
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
            self.is_ready = True
        if self.config.metrics_port is not None and self.config.metrics_port >= 0:
            try:
                self.metrics_port = self.worker.metrics.serve(
                    self.config.host, self.config.metrics_port, ready=lambda: self.is_ready)
                log.info("Prometheus metrics on http://%s:%d/metrics (readiness: /ready)",
                         self.config.host, self.metrics_port)
            except OSError as e:  # serving matters more than metrics
                log.error("metrics endpoint not started on port %d: %s (use --metrics-port N, or "
                          "0 for any free port)", self.config.metrics_port, e)
        log.info("serving %s on %s:%d (%s, %s)", SERVICE_NAME, self.config.host, self.port,
                 "TLS" if self.config.tls_cert else "plaintext",
                 "bearer-token auth" if self.config.auth_token else "no auth")
        if hasattr(self.worker, "started_serving"):  # the engine process's: extra RPC processes
            self.worker.started_serving(self.config, self.port, self.http_port)

    def _on_engine_failure(self, failure) -> None:
        """Event loop: the engine is gone. Health reports NOT_SERVING at once (every stream has
        already been ended with UNAVAILABLE by the worker); serve_forever then exits."""
        if self.failure is not None:
            return
        self.failure = failure
        self.is_ready = False
        for name in ("", SERVICE_NAME):
            asyncio.ensure_future(self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING))
        self._failed.set()

    async def stop(self, grace: float | None = None, drain_delay: float | None = None) -> None:
        """Drain, with the listener open throughout (probes and load balancers see NOT_SERVING,
        not a refused connection): health goes NOT_SERVING (gRPC health and /ready); for
        `drain_delay` s (--drain-delay-s) new calls are still taken, so that load balancers that
        poll health stop sending first; then new Synthesize calls get UNAVAILABLE, in-flight
        streams get `grace` s to finish, the connections stay open until a client playing in real
        time has received every finished stream's audio (within the grace period), and the
        listener closes."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.is_ready = False
        if hasattr(self.worker, "begin_drain"):  # extra RPC processes drain alongside
            self.worker.begin_drain()
        await self.health.enter_graceful_shutdown()
        delay = self.config.drain_delay_s if drain_delay is None else drain_delay
        if delay > 0:
            log.info("health NOT_SERVING; new calls still taken for %.1f s (--drain-delay-s)", delay)
            await asyncio.sleep(delay)
        grace = self.config.grace_period_s if grace is None else grace
        deadline = time.monotonic() + grace
        self.servicer.draining = True  # also HTTP's: new speech requests get 503
        while ((self.servicer.num_in_flight or self.worker.num_outstanding)
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)
        # A finished call's last audio and status may still sit in the connection (flow control:
        # a client, or a proxy in front of one, that reads at playback pace); closing now would
        # cut them off. Keep the connections until a real-time player has had it all.
        linger = min(deadline, self.servicer.playback_ends_at) - time.monotonic()
        if linger > 0:
            log.info("draining: connections kept %.1f s more for clients still receiving audio",
                     linger)
            await asyncio.sleep(linger)
        # calls still running past the grace period are cancelled; a call that has just ended
        # gets a moment to write its last message
        await self.server.stop(max(deadline - time.monotonic(), min(grace, 0.5)))
        if self.http is not None:
            await self.http.stop()
        self.worker.metrics.close()
        if self.owns_worker and self.failure is None:
            await asyncio.to_thread(self.worker.stop, 10.0)

    async def serve_forever(self) -> int:
        """Serve until SIGTERM/SIGINT (drain, return 0) or an engine failure (health goes
        NOT_SERVING, in-flight streams get UNAVAILABLE, return EXIT_ENGINE_FAILURE)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda s=sig: (
                log.info("%s: draining for up to %.0f s", signal.Signals(s).name,
                         self.config.drain_delay_s + self.config.grace_period_s),
                asyncio.ensure_future(self.stop())))
        await self.start()
        terminated = asyncio.ensure_future(self.server.wait_for_termination())
        failed = asyncio.ensure_future(self._failed.wait())
        await asyncio.wait((terminated, failed), return_when=asyncio.FIRST_COMPLETED)
        for f in (terminated, failed):
            f.cancel()
        if self.failure is not None:
            # Every stream has been ended with UNAVAILABLE; give those statuses and the
            # NOT_SERVING health answers a moment to reach clients and probes, then go without
            # a drain: the engine thread may be stuck for good.
            await asyncio.sleep(1.0)
            self.worker.metrics.close()
            log.critical("exiting with status %d: %s", EXIT_ENGINE_FAILURE, self.failure)
            return EXIT_ENGINE_FAILURE
        await self.stop()
        return 0
