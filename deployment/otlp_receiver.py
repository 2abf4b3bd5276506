"""An in-process OTLP/gRPC trace receiver: collects the spans servers export, for ``specserve trace``,
the tracing benchmark and the tests (no tracing backend needed)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind)


def _attributes(items: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in items}


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, flattened: ids as hex, times in Unix nanoseconds, the exporter's service."""

    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    name: str
    service: str  # the resource's service.name
    start_ns: int
    end_ns: int
    kind: int = 0
    attributes: dict[str, Any] = field(default_factory=dict)
    links: tuple[tuple[str, str], ...] = ()  # (trace id, span id) of each linked span
    status_code: int = 0  # 0 unset, 1 ok, 2 error
    status_message: str = ""
    resource: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        """Seconds from start to end."""
        return (self.end_ns - self.start_ns) / 1e9


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,  # noqa: N802
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        spans = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(ReceivedSpan(
                        trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(), name=span.name, service=service,
                        start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano, kind=span.kind,
                        attributes=_attributes(span.attributes),
                        links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                        status_code=span.status.code, status_message=span.status.message, resource=resource))
        self.receiver.add(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """A TraceService on a loopback port that keeps every span it receives in memory.

    Use as a context manager, or start()/stop(). Thread-safe; wait_for() blocks until a condition on
    the received spans holds.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self._requested_port = port
        self.port = 0
        self._spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        self._server: grpc.Server | None = None

    @property
    def endpoint(self) -> str:
        """The value for ``OTEL_EXPORTER_OTLP_ENDPOINT`` of processes that should export here."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> OtlpReceiver:
        """Bind (port 0 = a free port) and serve; returns self."""
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                             options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)])
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), server)
        self.port = server.add_insecure_port(f"{self.host}:{self._requested_port}")
        if self.port == 0:
            raise OSError(f"cannot bind the OTLP receiver to {self.host}:{self._requested_port}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        """Stop serving (spans received so far stay readable)."""
        if self._server is not None:
            self._server.stop(grace=0.5).wait()
            self._server = None

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add(self, spans: list[ReceivedSpan]) -> None:
        """Store spans and wake waiters."""
        with self._changed:
            self._spans.extend(spans)
            self._changed.notify_all()

    def spans(self) -> list[ReceivedSpan]:
        """A snapshot of every span received so far."""
        with self._changed:
            return list(self._spans)

    def clear(self) -> None:
        """Forget the spans received so far."""
        with self._changed:
            self._spans.clear()

    def wait_for(self, condition: Callable[[list[ReceivedSpan]], bool], timeout_s: float) -> list[ReceivedSpan]:
        """Block until ``condition(spans)`` holds; returns the spans then. Raises TimeoutError otherwise."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not condition(list(self._spans)):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"spans not complete after {timeout_s:.0f}s ({len(self._spans)} received)")
                self._changed.wait(min(remaining, 0.5))
            return list(self._spans)
