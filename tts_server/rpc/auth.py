"""Bearer-token check for every RPC except health and reflection."""

from __future__ import annotations

import hmac

import grpc

# Health: supervisors probe without credentials. Reflection: it serves only the schema, which is
# public (protos/), and tools such as `buf curl` do not send -H headers to it, so a call with the
# right token would otherwise fail as "service not found".
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                   "/grpc.reflection.v1.ServerReflection/")


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "missing or invalid bearer token (metadata 'authorization: Bearer <token>')")

    kwargs = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    return grpc.stream_stream_rpc_method_handler(deny, **kwargs)


def bearer_token(value: str | bytes) -> bytes:
    """The credentials of an `authorization` value whose scheme is Bearer (matched without
    regard to case, RFC 7235 section 2.1), else b""."""
    if isinstance(value, str):
        value = value.encode()
    scheme, _, credentials = value.strip().partition(b" ")
    return credentials.strip() if scheme.lower() == b"bearer" else b""


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED unless the call carries `authorization: Bearer <token>`."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("empty auth token")
        self._expected = token.encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(EXEMPT_PREFIXES):
            return handler
        given = bearer_token(dict(details.invocation_metadata or ()).get("authorization", ""))
        if hmac.compare_digest(given, self._expected):
            return handler
        return _denied(handler)
