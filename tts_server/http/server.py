"""The HTTP listener beside the gRPC one: aiohttp's AppRunner in the same event loop, submitting
to the same engine worker (in every RPC process, on the one port). Routes: POST /v1/audio/speech,
GET /v1/models, /health, /ready."""

from __future__ import annotations

import hmac
import logging
import ssl
import time

from aiohttp import web

from .errors import APIError
from .speech import SpeechHandler
from .speech_request import served_model_ids

log = logging.getLogger(__name__)

UNAUTHENTICATED_PATHS = ("/health", "/ready")  # probes carry no credentials, as gRPC health


def _error_shape(exc: web.HTTPException) -> APIError:
    """aiohttp's own refusals (404, 405, 413, ...) in OpenAI's shape."""
    if exc.status == 413:
        return APIError(413, f"request body exceeds --max-request-bytes ({exc.text})",
                        "invalid_request_error", "body", "request_too_large")
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    return APIError(exc.status, exc.reason, kind, None, None)


class HTTPServer:
    """Serves the OpenAI-compatible speech API. `ready()` is what gRPC health says (false from the
    start of a drain, /ready then answers 503); `accepting()` turns false once the drain stops
    taking calls (after --drain-delay-s) or the engine failed: new speech requests get 503."""

    def __init__(self, worker, info, config, ready, accepting):
        self.worker, self.info, self.config = worker, info, config
        self.ready, self.accepting = ready, accepting
        self.created = int(time.time())
        self._expected = f"Bearer {config.auth_token}".encode() if config.auth_token else None
        app = web.Application(client_max_size=config.max_request_bytes,
                              middlewares=[self._errors, self._auth])
        app.router.add_post("/v1/audio/speech", SpeechHandler(worker, info, config).__call__)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        # a client that hangs up cancels its handler at once, which frees its engine slot
        # (the server drains streams before it stops this runner: what is left then is cut)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None,
                                     handler_cancellation=True, shutdown_timeout=1.0)
        self.port: int | None = None

    def _ssl_context(self) -> ssl.SSLContext | None:
        if not self.config.tls_cert:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.config.tls_cert, self.config.tls_key)
        return ctx

    async def start(self, port: int) -> int:
        """Listen on --host:port (0: any free port); returns the bound port. With several RPC
        processes each has this listener on the same port (SO_REUSEPORT: the kernel spreads the
        connections over them, as for gRPC); one process alone keeps the port to itself."""
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, port, ssl_context=self._ssl_context(),
                           reuse_port=self.config.several_rpc_processes)
        await site.start()
        self.port = self._runner.addresses[0][1]
        log.info("OpenAI-compatible speech API on %s://%s:%d/v1/audio/speech",
                 "https" if self.config.tls_cert else "http", self.config.host, self.port)
        return self.port

    async def stop(self) -> None:
        """Close the listener and the connections (in-flight streams have drained by now)."""
        await self._runner.cleanup()

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except APIError as e:
            return e.response()
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _error_shape(e).response()

    @web.middleware
    async def _auth(self, request, handler):
        if self._expected is not None and request.path not in UNAUTHENTICATED_PATHS:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, self._expected):
                raise APIError(401, "missing or invalid bearer token (header 'Authorization: "
                                    "Bearer <token>')", "invalid_request_error", None,
                               "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        if not self.accepting() and request.path.startswith("/v1/audio/"):
            raise APIError(503, "server is draining or its engine failed; retry on another "
                                "replica", "server_error", None, "not_ready", {"Retry-After": "1"})
        return await handler(request)

    async def _models(self, request):
        data = [{"id": name, "object": "model", "created": self.created,
                 "owned_by": "qwen3-tts-server"} for name in served_model_ids(self.info)]
        return web.json_response({"object": "list", "data": data})

    async def _health(self, request):
        return web.json_response({"status": "ok"})

    async def _ready(self, request):
        if self.ready():
            return web.json_response({"status": "ready", "model": self.info.name})
        return APIError(503, "not ready: draining or the engine failed", "server_error", None,
                        "not_ready").response()
