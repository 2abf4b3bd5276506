"""Start-up of the coordinator: connect to the model services, check the pair, serve the public API."""

from __future__ import annotations

import argparse
import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from coordinator.draft_length import DraftLength
from coordinator.model_clients import ModelEndpoint, check_compatible, connect
from coordinator.scheduler import Scheduler, SchedulerConfig
from coordinator.servicer import SERVICE_NAME, CoordinatorServicer
from coordinator.text import TextCodec
from coordinator.validation import Limits
from specserve.grpc_server import CHANNEL_OPTIONS
from specserve.tls import TLSFiles
from specserve.v1 import coordinator_pb2_grpc

log = logging.getLogger(__name__)


async def serve_coordinator(args: argparse.Namespace) -> int:
    """Connect to the target (and draft), then serve Coordinator, health and reflection until cancelled."""
    tls = TLSFiles(args.tls_cert, args.tls_key, args.tls_ca)
    target = await connect(args.target, "target", tls, args.connect_timeout)
    draft: ModelEndpoint | None = None
    if args.draft:
        draft = await connect(args.draft, "draft", tls, args.connect_timeout)
        check_compatible(draft.info, target.info)
    max_context = min([target.info.max_context] + ([draft.info.max_context] if draft else []))
    limits = Limits(vocab_size=target.info.vocab_size, max_context=max_context, max_n=args.max_n)
    scheduler = Scheduler(
        target, draft, TextCodec(target.info.tokenizer_json),
        DraftLength(args.draft_len, args.max_draft_len, adaptive=not args.fixed_draft_len),
        SchedulerConfig(max_batch_sequences=args.max_batch_sequences, max_queue=args.max_queue,
                        model_timeout_s=args.model_timeout, draft_timeout_s=args.draft_timeout),
    )
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(scheduler, limits), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{args.host}:{args.port}"
    if tls.enabled:
        bound = server.add_secure_port(address, tls.server_credentials())
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("coordinator on %s:%d (target %s, draft %s)", args.host, bound, args.target, args.draft or "none")
    loop_task = asyncio.create_task(scheduler.run())
    try:
        await server.wait_for_termination()
    finally:
        loop_task.cancel()
        await server.stop(grace=1)
    return 0

