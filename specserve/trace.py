"""Trace one request through coordinator, draft and target and draw where the time goes.

Needs no tracing backend: an in-process OTLP/gRPC receiver collects the spans. By default the command
starts its own deployment (``--target-model``/``--draft-model``) exporting to that receiver, sends one
request carrying a W3C traceparent, waits for every span of it, and writes a waterfall (HTML, and PNG
with ``--png``). With ``--coordinator`` it uses running servers instead: start them with
``OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:PORT`` and pass the same ``--receiver-port PORT``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from deployment.arguments import add_workload_arguments, resolve_model_pair
from deployment.otlp_receiver import OtlpReceiver, ReceivedSpan
from deployment.processes import Deployment
from serving.grpc_server import open_channel
from serving.tls import TLSFiles
from specserve.generate import print_response
from specserve.v1 import coordinator_pb2, coordinator_pb2_grpc

CLIENT_SERVICE = "specserve-client"
# Environment of the servers of a traced deployment: export quickly so the trace is complete soon.
TRACE_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_TRACES_SAMPLER": "parentbased_always_on"}


def request_trace(spans: list[ReceivedSpan], trace_id: str) -> list[ReceivedSpan]:
    """The spans of one request: its trace, plus the traces of the rounds whose round span links to a
    span of it (a round serves many requests, so it is a trace of its own)."""
    own = [s for s in spans if s.trace_id == trace_id]
    own_ids = {s.span_id for s in own}
    round_traces = {s.trace_id for s in spans
                    if s.name == "coordinator.round" and any(t == trace_id and i in own_ids for t, i in s.links)}
    return own + [s for s in spans if s.trace_id in round_traces]


def trace_complete(spans: list[ReceivedSpan], trace_id: str) -> bool:
    """True once the request span arrived and every coordinator prefill and round of the request has the
    service-side spans it called (target prefill/verify, draft prefill/propose when a draft took part)."""
    mine = request_trace(spans, trace_id)
    if not any(s.name == "coordinator.generate" for s in mine):
        return False
    children: dict[str, set[str]] = {}
    for span in mine:
        children.setdefault(span.parent_span_id, set()).add(span.name)
    # (span name, service child it always has, service child it has when the attribute is set)
    expected = {"coordinator.prefill": ("target.prefill", "draft.prefill", "specserve.with_draft"),
                "coordinator.round": ("target.verify", "draft.propose", "specserve.draft_len")}
    for span in mine:
        if span.name not in expected or span.status_code == 2:
            continue
        below = children.get(span.span_id, set())
        target_child, draft_child, draft_flag = expected[span.name]
        if target_child not in below or (span.attributes.get(draft_flag) and draft_child not in below):
            return False
    return True


def collect(receiver: OtlpReceiver, trace_id: str, timeout_s: float = 30.0, settle_s: float = 0.3
            ) -> list[ReceivedSpan]:
    """Wait until the request's trace is complete (then ``settle_s`` for stragglers); returns its spans."""
    receiver.wait_for(lambda spans: trace_complete(spans, trace_id), timeout_s)
    time.sleep(settle_s)
    return request_trace(receiver.spans(), trace_id)


@contextlib.contextmanager
def client_tracer(endpoint: str) -> Iterator[Any]:
    """A tracer of this process (service ``specserve-client``) exporting synchronously to ``endpoint``;
    independent of the global provider. Flushed and shut down on exit."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider(resource=Resource({SERVICE_NAME: CLIENT_SERVICE}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    try:
        yield provider.get_tracer("specserve.client")
    finally:
        provider.shutdown()


def traced_generate(stub: coordinator_pb2_grpc.CoordinatorStub, request: coordinator_pb2.GenerateRequest,
                    endpoint: str, timeout_s: float = 600.0) -> tuple[coordinator_pb2.GenerateResponse, str]:
    """Send one Generate inside a ``client.generate`` span exported to ``endpoint``, with its traceparent
    in the call metadata. Returns (response, trace id as hex)."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    with client_tracer(endpoint) as tracer, tracer.start_as_current_span(
            "client.generate", kind=trace.SpanKind.CLIENT,
            attributes={"rpc.method": "Generate", "specserve.n": request.n}) as span:
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
        response = stub.Generate(request, timeout=timeout_s, metadata=tuple(carrier.items()))
        span.set_attribute("gen_ai.usage.output_tokens", response.usage.completion_tokens)
        trace_id = format(span.get_span_context().trace_id, "032x")
    return response, trace_id


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``specserve trace``."""
    parser.add_argument("--coordinator", help="HOST:PORT of running servers that export to --receiver-port "
                                              "(default: start a deployment of --target-model/--draft-model)")
    parser.add_argument("--receiver-port", type=int, default=0, help="port of the in-process OTLP receiver "
                                                                     "(0 = any free port)")
    add_workload_arguments(parser, max_new_tokens=32, temperature=0.0, top_p=1.0, seed=0, optional_draft=True)
    parser.add_argument("--out", default="trace.html", help="HTML waterfall to write")
    parser.add_argument("--png", help="also write the waterfall as a PNG here")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the spans")


def _trace(args: argparse.Namespace, receiver: OtlpReceiver, address: str) -> int:
    stub = coordinator_pb2_grpc.CoordinatorStub(open_channel(address, TLSFiles()))
    request = coordinator_pb2.GenerateRequest(prompt=args.prompt, n=args.n, max_new_tokens=args.max_new_tokens,
                                              temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    try:
        response, trace_id = traced_generate(stub, request, f"127.0.0.1:{receiver.port}")
    except grpc.RpcError as error:
        print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    print_response(response, args.prompt)
    try:
        spans = collect(receiver, trace_id, args.timeout)
    except TimeoutError as error:
        print(f"error: trace {trace_id} incomplete: {error}; do the servers export to {receiver.endpoint}?",
              file=sys.stderr)
        spans = request_trace(receiver.spans(), trace_id)
        if not spans:
            return 1
    title = f"specserve trace {trace_id} (n={args.n}, {response.usage.completion_tokens} tokens, " \
            f"{response.usage.rounds} rounds)"
    from specserve.waterfall import render_html, render_png, summary

    print(f"--- trace {trace_id}: {len(spans)} spans from {sorted({s.service for s in spans})}")
    for service, name, count, seconds in summary(spans)[:12]:
        print(f"{service:>22} {name:<24} {count:>5} x  {seconds * 1e3:9.2f} ms")
    print(f"wrote {render_html(spans, args.out, title)}")
    if args.png:
        print(f"wrote {render_png(spans, args.png, title)}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Trace one request end to end and write the waterfall; returns 0 on success."""
    with OtlpReceiver(port=args.receiver_port) as receiver:
        if args.coordinator:
            print(f"OTLP receiver on {receiver.endpoint}", flush=True)
            return _trace(args, receiver, args.coordinator)
        resolve_model_pair(args)
        with tempfile.TemporaryDirectory() as logs:
            print(f"starting draft, target and coordinator exporting to {receiver.endpoint} (logs in {logs}) ...",
                  flush=True)
            env = {**TRACE_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
            with Deployment(args.target_model, args.draft_model or None, log_dir=Path(logs), env=env) as deployment:
                return _trace(args, receiver, deployment.coordinator_address)
