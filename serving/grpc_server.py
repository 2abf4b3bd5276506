"""Server plumbing every specserve process shares: message limits, health, reflection, TLS."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from concurrent import futures
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.errors import InvalidInput, KVBudgetExceeded, ModelLoading, UnknownBatch
from serving.compute_loop import LoopClosed
from serving.tls import TLSFiles

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

# Exceptions of the runtime and the gRPC status each becomes.
class CallerGone(RuntimeError):
    """The caller cancelled or its deadline passed before the work was done; nothing was kept."""


STATUS_OF: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (CallerGone, grpc.StatusCode.DEADLINE_EXCEEDED),
    (InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownBatch, grpc.StatusCode.NOT_FOUND),
    (KVBudgetExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ModelLoading, grpc.StatusCode.UNAVAILABLE),
    (LoopClosed, grpc.StatusCode.UNAVAILABLE),
]

Handler = TypeVar("Handler", bound=Callable[..., Any])


def status_of(error: BaseException) -> grpc.StatusCode:
    """The gRPC status code for a runtime exception (INTERNAL for anything unexpected)."""
    for kind, code in STATUS_OF:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def grpc_errors(method: Handler) -> Handler:
    """Wrap a sync servicer method so runtime exceptions become a status with their message."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as error:  # noqa: BLE001 - every failure must become a status
            code = status_of(error)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", method.__name__)
            context.abort(code, str(error) or type(error).__name__)

    return wrapper  # type: ignore[return-value]


def create_server(service_names: Iterable[str], host: str, port: int, tls: TLSFiles, max_workers: int = 16,
                  interceptors: Iterable[grpc.ServerInterceptor] = ()
                  ) -> tuple[grpc.Server, health.HealthServicer, int]:
    """A started-later sync server bound to host:port with health (NOT_SERVING until told) and reflection.

    Returns (server, health servicer, bound port); port 0 picks a free port.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=CHANNEL_OPTIONS,
                         interceptors=list(interceptors))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    for name in ["", *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return server, health_servicer, bind(server, f"{host}:{port}", tls)


def bind(server: grpc.Server | grpc.aio.Server, address: str, tls: TLSFiles) -> int:
    """Add a (TLS when configured) listening port to a sync or asyncio server; returns the bound port."""
    if tls.enabled:
        bound = server.add_secure_port(address, tls.server_credentials())
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    return bound


def set_serving(health_servicer: health.HealthServicer, service_names: Iterable[str], serving: bool) -> None:
    """Report SERVING or NOT_SERVING for the server and each named service."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        health_servicer.set(name, status)


def open_channel(target: str, tls: TLSFiles) -> grpc.Channel:
    """A sync channel to host:port with specserve's message limits (TLS when configured)."""
    if tls.enabled:
        return grpc.secure_channel(target, tls.channel_credentials(), options=CHANNEL_OPTIONS)
    return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
