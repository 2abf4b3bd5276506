"""specserve.v1.Coordinator: validates requests, hands them to the router, answers or streams."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from coordinator.request import Request
from coordinator.router import Router
from coordinator.scheduler import QueueFull
from coordinator.validation import InvalidRequest, Limits, validate_request
from specserve.v1 import coordinator_pb2, coordinator_pb2_grpc

SERVICE_NAME = "specserve.v1.Coordinator"
RETRY_AFTER_S = 1


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """The public API over the router."""

    def __init__(self, router: Router, max_n: int) -> None:
        self.router = router
        self.max_n = max_n

    def _limits(self) -> Limits:
        return Limits(vocab_size=self.router.reference.info.vocab_size, max_context=self.router.max_context,
                      max_n=self.max_n)

    async def _submit(self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
                      stream: bool) -> Request:
        try:
            spec = validate_request(request, self._limits(), self.router.codec)
        except InvalidRequest as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        try:
            return self.router.submit(spec, stream=stream, deadline=deadline)
        except QueueFull as error:
            context.set_trailing_metadata((("retry-after", str(RETRY_AFTER_S)),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{error} (retry-after: {RETRY_AFTER_S}s)")

    async def Generate(self, request: coordinator_pb2.GenerateRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> coordinator_pb2.GenerateResponse:
        job = await self._submit(request, context, stream=False)
        try:
            await job.done.wait()
        except asyncio.CancelledError:
            self.router.cancel(job)
            raise
        if job.error is not None:
            await context.abort(*job.error)
        completions = [coordinator_pb2.Completion(index=s.index, token_ids=s.token_ids, text=s.text,
                                                  finish_reason=s.finish_reason) for s in job.samples]
        return coordinator_pb2.GenerateResponse(completions=completions, usage=job.usage, timing=job.timing())

    async def GenerateStream(self, request: coordinator_pb2.GenerateRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> AsyncIterator[coordinator_pb2.GenerateChunk]:
        job = await self._submit(request, context, stream=True)
        try:
            while (chunk := await job.chunks.get()) is not None:
                yield chunk
        except asyncio.CancelledError:
            self.router.cancel(job)
            raise
        if job.error is not None:
            await context.abort(*job.error)
        yield coordinator_pb2.GenerateChunk(usage=job.usage, timing=job.timing())
