"""Tracing set-up and W3C trace-context propagation over gRPC metadata.

Tracing is configured from the standard ``OTEL_*`` environment variables. It is ON only when an OTLP
endpoint is configured (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) and
neither ``OTEL_SDK_DISABLED=true`` nor ``OTEL_TRACES_EXPORTER=none`` says otherwise. Then spans go to
that endpoint over OTLP/gRPC through a BatchSpanProcessor (``OTEL_BSP_*`` tune it), sampled as
``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG`` say (default: parent-based, always on), with the
resource attributes ``service.name`` (``OTEL_SERVICE_NAME``, default ``specserve-<role>``) and
``service.instance.id``. When tracing is off nothing is installed: the helpers below return before
touching OpenTelemetry, so the serving path pays one boolean test per call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

log = logging.getLogger(__name__)

TRACER_NAME = "specserve"
# Attribute every specserve span carries (OpenTelemetry GenAI semantic conventions).
GEN_AI_SYSTEM = {"gen_ai.system": "specserve"}
INVALID_SPAN = trace.INVALID_SPAN

_enabled = False
_provider: Any = None


def tracing_configured(environ: Mapping[str, str] | None = None) -> bool:
    """True when the environment asks for trace export (an OTLP endpoint, SDK not disabled, exporter not none)."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def enabled() -> bool:
    """True once setup_tracing() installed an exporting TracerProvider in this process."""
    return _enabled


def setup_tracing(role: str, environ: Mapping[str, str] | None = None) -> bool:
    """Install the process's TracerProvider from the ``OTEL_*`` environment; returns whether tracing is on.

    Idempotent. When on, spans are exported by a BatchSpanProcessor to the OTLP/gRPC endpoint, and the
    provider is flushed and shut down at interpreter exit and on SIGTERM (the default SIGTERM action
    then proceeds). When off, no provider, exporter or thread is created.
    """
    global _enabled, _provider
    if _enabled:
        return True
    if not tracing_configured(environ):
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({SERVICE_INSTANCE_ID: f"{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: f"specserve-{role}"}))
    provider = TracerProvider(resource=resource)  # sampler from OTEL_TRACES_SAMPLER; flushes at exit
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider, _enabled = provider, True
    _flush_on_sigterm()
    log.info("tracing on: %s exports OTLP/gRPC spans to %s", resource.attributes.get(SERVICE_NAME),
             os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    return True


def shutdown_tracing(timeout_ms: int = 5000) -> None:
    """Export the spans still buffered (up to ``timeout_ms``) and stop the exporter; a no-op when off."""
    global _enabled
    if _provider is not None and _enabled:
        _enabled = False
        _provider.force_flush(timeout_ms)
        _provider.shutdown()


def _flush_on_sigterm() -> None:
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: Any) -> None:
        shutdown_tracing()
        if callable(previous):
            previous(signum, frame)
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous in (None, signal.SIG_DFL) else previous)
        os.kill(os.getpid(), signal.SIGTERM)

    with contextlib.suppress(ValueError):  # not the main thread: rely on the atexit flush
        signal.signal(signal.SIGTERM, handler)


def tracer() -> trace.Tracer:
    """specserve's tracer (a no-op tracer when tracing is off)."""
    return trace.get_tracer(TRACER_NAME)


# -- propagation ---------------------------------------------------------------------------------------
def inject_metadata(span: Span | None = None, metadata: Iterable[tuple[str, str]] = ()
                    ) -> tuple[tuple[str, str], ...] | None:
    """gRPC call metadata carrying ``span``'s context (or the current one) as W3C ``traceparent``.

    Returns ``metadata`` unchanged (None when empty) when tracing is off or there is no span to carry.
    """
    base = tuple(metadata)
    if not _enabled:
        return base or None
    carrier: dict[str, str] = {}
    context = trace.set_span_in_context(span) if span is not None else None
    propagate.inject(carrier, context=context)
    return (*base, *carrier.items()) or None


def extract_context(metadata: Iterable[Any] | None) -> Context:
    """The trace context a caller sent in its gRPC metadata (an empty context when it sent none)."""
    carrier = {str(item[0]).lower(): item[1] for item in metadata or () if isinstance(item[1], str)}
    return propagate.extract(carrier)


@contextlib.contextmanager
def server_span(name: str, grpc_context: Any, attributes: Mapping[str, Any] | None = None) -> Iterator[Span]:
    """A SERVER span, current for the block, whose parent is the context the caller propagated.

    Works with sync and asyncio servicer contexts (both expose invocation_metadata()). Exceptions are
    recorded on the span and re-raised. When tracing is off it yields a non-recording span.
    """
    if not _enabled:
        yield trace.INVALID_SPAN
        return
    parent = extract_context(grpc_context.invocation_metadata())
    with tracer().start_as_current_span(name, context=parent, kind=SpanKind.SERVER,
                                        attributes={**GEN_AI_SYSTEM, **(attributes or {})}) as span:
        yield span


def start_span(name: str, parent: Span | Context | None = None, links: Iterable[Span | None] = (),
               attributes: Mapping[str, Any] | None = None, kind: SpanKind = SpanKind.INTERNAL,
               start_time_ns: int | None = None) -> Span:
    """Start (not make current) a span under ``parent`` (a span, a context, or None for a new trace),
    linked to each recording span of ``links``. The caller ends it. Non-recording when tracing is off."""
    if not _enabled:
        return trace.INVALID_SPAN
    if isinstance(parent, Context):
        context = parent
    else:
        context = trace.set_span_in_context(parent) if parent is not None else Context()
    span_links = [Link(s.get_span_context()) for s in links if s is not None and s.get_span_context().is_valid]
    return tracer().start_span(name, context=context, kind=kind, links=span_links,
                               attributes={**GEN_AI_SYSTEM, **(attributes or {})}, start_time=start_time_ns)


def error_status(error: BaseException) -> Status:
    """An ERROR span status describing ``error`` (a gRPC error shows its status code and details)."""
    code = getattr(error, "code", None)
    if callable(code):
        details = error.details() if callable(getattr(error, "details", None)) else ""
        return Status(StatusCode.ERROR, f"{code().name}: {details}")
    return Status(StatusCode.ERROR, f"{type(error).__name__}: {error}")
