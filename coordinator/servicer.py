"""specserve.v1.Coordinator: validates requests, hands them to the scheduler, answers or streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from coordinator.scheduler import QueueFull, Request, Scheduler
from coordinator.validation import InvalidRequest, Limits, validate_request
from specserve.v1 import coordinator_pb2, coordinator_pb2_grpc

SERVICE_NAME = "specserve.v1.Coordinator"
RETRY_AFTER_S = 1


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """The public API over one scheduler."""

    def __init__(self, scheduler: Scheduler, limits: Limits) -> None:
        self.scheduler = scheduler
        self.limits = limits

    async def _submit(self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
                      stream: bool) -> Request:
        try:
            spec = validate_request(request, self.limits, self.scheduler.codec)
        except InvalidRequest as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        try:
            return self.scheduler.submit(spec, stream=stream)
        except QueueFull as error:
            await context.set_trailing_metadata((("retry-after", str(RETRY_AFTER_S)),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{error} (retry-after: {RETRY_AFTER_S}s)")

    async def Generate(self, request: coordinator_pb2.GenerateRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> coordinator_pb2.GenerateResponse:
        job = await self._submit(request, context, stream=False)
        try:
            await job.done.wait()
        except asyncio.CancelledError:
            self.scheduler.cancel(job)
            raise
        if job.error is not None:
            await context.abort(*job.error)
        completions = [coordinator_pb2.Completion(index=s.index, token_ids=s.token_ids, text=s.text,
                                                  finish_reason=s.finish_reason) for s in job.samples]
        return coordinator_pb2.GenerateResponse(completions=completions, usage=job.usage)

    async def GenerateStream(self, request: coordinator_pb2.GenerateRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> AsyncIterator[coordinator_pb2.GenerateChunk]:
        job = await self._submit(request, context, stream=True)
        try:
            while (chunk := await job.chunks.get()) is not None:
                yield chunk
        except asyncio.CancelledError:
            self.scheduler.cancel(job)
            raise
        if job.error is not None:
            await context.abort(*job.error)
        yield coordinator_pb2.GenerateChunk(usage=job.usage)
