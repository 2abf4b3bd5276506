"""Bearer-token authentication of the public Coordinator API."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

PROTECTED_PREFIX = "/specserve.v1.Coordinator/"


def _deny(method: str, message: str) -> grpc.RpcMethodHandler:
    async def abort(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if method.endswith("Stream"):
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` on Coordinator methods (health and reflection stay open)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the bearer token is empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """Pass authorized calls on; answer the others with UNAUTHENTICATED."""
        if not handler_call_details.method.startswith(PROTECTED_PREFIX):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        presented = str(metadata.get("authorization", "")).encode()
        if not hmac.compare_digest(presented, self._expected):
            return _deny(handler_call_details.method,
                         "missing or wrong bearer token: send metadata 'authorization: Bearer <token>'")
        return await continuation(handler_call_details)
