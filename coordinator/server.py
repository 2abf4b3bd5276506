"""Start-up of the coordinator: discover the model replicas, check the pair, serve the public API."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from coordinator.auth import BearerTokenInterceptor
from coordinator.discovery import parse_endpoint_spec
from coordinator.draft_length import DraftLength
from coordinator.replicas import ReplicaPool
from coordinator.router import Router
from coordinator.scheduler import SchedulerConfig
from coordinator.servicer import SERVICE_NAME, CoordinatorServicer
from coordinator.speculation_gate import SpeculationGate
from serving import telemetry
from serving.grpc_server import CHANNEL_OPTIONS, bind
from serving.metrics import CoordinatorMetrics, start_metrics_server
from serving.tls import TLSFiles
from specserve.v1 import coordinator_pb2_grpc

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0


async def serve_coordinator(args: argparse.Namespace) -> int:
    """Connect to the target (and draft) replicas, then serve Coordinator, health and reflection.

    Tracing follows the ``OTEL_*`` environment (see serving.telemetry); Prometheus metrics are served
    on ``--metrics-port`` when it is non-zero.
    """
    telemetry.setup_tracing("coordinator")
    metrics = CoordinatorMetrics()
    if start_metrics_server(metrics.registry, args.host, getattr(args, "metrics_port", 0)):
        log.info("metrics on http://%s:%d/metrics", args.host, args.metrics_port)
    tls = TLSFiles(args.tls_cert, args.tls_key, args.tls_ca, args.tls_client_auth)
    targets = ReplicaPool("target", parse_endpoint_spec(args.target), tls)
    drafts = ReplicaPool("draft", parse_endpoint_spec(args.draft), tls) if args.draft else None
    config = SchedulerConfig(max_batch_sequences=args.max_batch_sequences, max_batch_tokens=args.max_batch_tokens,
                             max_queue=args.max_queue, model_timeout_s=args.model_timeout,
                             draft_timeout_s=args.draft_timeout, prompt_lookup=args.prompt_lookup)

    def draft_length() -> DraftLength:  # one per target replica's scheduler
        mode = "off" if args.fixed_draft_len else args.speculation_gate
        return DraftLength(args.draft_len, args.max_draft_len, not args.fixed_draft_len,
                           SpeculationGate.for_mode(mode, args.speculation_probe_every))

    try:
        draft_length()  # flags that cannot work end the process before anything connects
    except ValueError as error:
        raise SystemExit(f"specserve serve coordinator: {error}") from None

    router = Router(targets, drafts, config, draft_length, metrics, prefix_affinity_slack=args.prefix_affinity_slack)
    await router.start(args.connect_timeout)
    interceptors = []
    if args.auth_token_file:
        interceptors.append(BearerTokenInterceptor(Path(args.auth_token_file).read_text().strip()))
    server = grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=interceptors)
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(router, args.max_n), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = bind(server, f"{args.host}:{args.port}", tls)
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("coordinator on %s:%d (target %s, draft %s)", args.host, bound, args.target, args.draft or "none")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(_shutdown(server, health_servicer)))
    try:
        await server.wait_for_termination()
    finally:
        await router.stop()
        await server.stop(grace=1)
    return 0


async def _shutdown(server: grpc.aio.Server, health_servicer: health.aio.HealthServicer) -> None:
    """Report NOT_SERVING, then stop accepting calls and let running ones finish within the grace period."""
    log.info("coordinator shutting down: NOT_SERVING, draining for up to %.0fs", SHUTDOWN_GRACE_S)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(SHUTDOWN_GRACE_S)
