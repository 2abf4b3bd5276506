"""Async connections from the coordinator to the draft and target services."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.grpc_server import CHANNEL_OPTIONS
from serving.tls import TLSFiles
from specserve.v1 import model_pb2, model_pb2_grpc

SERVICE_OF_ROLE = {"draft": "specserve.v1.DraftModel", "target": "specserve.v1.TargetModel"}


class IncompatibleModels(RuntimeError):
    """The draft and target cannot be paired (different tokenizers or vocabularies)."""


@dataclass
class ModelEndpoint:
    """A model service: its address, stub and the ModelInfo it reported."""

    address: str
    role: str
    channel: grpc.aio.Channel
    stub: Any
    info: model_pb2.ModelInfo
    healthy: bool = True
    batches: int = 0  # running batches pinned to this replica

    @property
    def service(self) -> str:
        """The gRPC service name of the role."""
        return SERVICE_OF_ROLE[self.role]

    async def check_health(self, timeout_s: float = 1.0) -> bool:
        """Ask the replica's health service; updates and returns ``healthy``."""
        try:
            reply = await health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(service=self.service), timeout=timeout_s)
            self.healthy = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            self.healthy = False
        return self.healthy

    async def stats(self, timeout_s: float = 5.0) -> model_pb2.ModelStats:
        """Batches, sequences and KV bytes the replica holds now."""
        return await self.stub.Stats(model_pb2.StatsRequest(), timeout=timeout_s)

    async def close(self) -> None:
        """Close the channel."""
        await self.channel.close()


def open_aio_channel(address: str, tls: TLSFiles) -> grpc.aio.Channel:
    """An asyncio channel with specserve's message limits (TLS when configured)."""
    if tls.enabled:
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=CHANNEL_OPTIONS)
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


async def connect(address: str, role: str, tls: TLSFiles, wait_s: float) -> ModelEndpoint:
    """Wait (up to ``wait_s``) until the service reports SERVING, then fetch its ModelInfo.

    Raises TimeoutError naming the address when the service is not ready in time.
    """
    channel = open_aio_channel(address, tls)
    stub_class = model_pb2_grpc.DraftModelStub if role == "draft" else model_pb2_grpc.TargetModelStub
    service = SERVICE_OF_ROLE[role]
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + wait_s
    last_error = "no answer"
    while time.monotonic() < deadline:
        try:
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                stub = stub_class(channel)
                info = await stub.Info(model_pb2.InfoRequest(), timeout=10.0)
                return ModelEndpoint(address, role, channel, stub, info)
            last_error = "NOT_SERVING (model loading)"
        except grpc.aio.AioRpcError as error:
            last_error = f"{error.code().name}: {error.details()}"
        await asyncio.sleep(0.25)
    await channel.close()
    raise TimeoutError(f"{role} service at {address} not ready after {wait_s:.0f}s ({last_error})")


def check_compatible(draft: model_pb2.ModelInfo, target: model_pb2.ModelInfo) -> None:
    """Raise IncompatibleModels unless draft and target share one tokenizer vocabulary."""
    if draft.vocab_size != target.vocab_size or draft.vocab_fingerprint != target.vocab_fingerprint:
        raise IncompatibleModels(
            f"draft {draft.model_name!r} and target {target.model_name!r} do not share a tokenizer "
            f"(vocab sizes {draft.vocab_size} vs {target.vocab_size}, fingerprints "
            f"{draft.vocab_fingerprint} vs {target.vocab_fingerprint}); pick a draft trained with the "
            "target's tokenizer"
        )
