"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the HTTP
status each of the server's refusals maps to."""

from __future__ import annotations

from aiohttp import web

from ..api import EngineFailure, InvalidRequest, Overloaded, ShuttingDown


class APIError(Exception):
    """Ends a request with `status` and an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code, self.headers = code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def invalid(param: str, message: str) -> APIError:
    """400 naming the request field; the message starts with it, as on gRPC."""
    return APIError(400, f"{param}: {message}", "invalid_request_error", param, "invalid_value")


def from_exception(error: BaseException | None, field_names: dict | None = None) -> APIError:
    """The APIError for a refusal at submission or a stream the engine ended with `error`.
    `field_names` maps the gRPC request's field names to this API's."""
    if isinstance(error, InvalidRequest):
        names = field_names or {}
        param = names.get(error.field, error.field)
        detail = str(error).split(": ", 1)[-1]
        return invalid(param, detail)
    if isinstance(error, Overloaded):
        return APIError(429, str(error), "rate_limit_error", None, "server_busy",
                        {"Retry-After": "1"})
    if isinstance(error, ShuttingDown):
        return APIError(503, str(error), "server_error", None, "draining", {"Retry-After": "1"})
    if isinstance(error, EngineFailure):
        return APIError(503, str(error), "server_error", None, "engine_failure",
                        {"Retry-After": "1"})
    return APIError(500, f"synthesis failed: {error}", "server_error", None, "synthesis_failed")
