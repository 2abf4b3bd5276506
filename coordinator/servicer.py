"""specserve.v1.Coordinator: validates requests, hands them to the router, answers or streams."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from coordinator.request import Request
from coordinator.router import Router
from coordinator.scheduler import QueueFull
from coordinator.validation import InvalidRequest, Limits, validate_request
from serving import telemetry
from specserve.v1 import coordinator_pb2, coordinator_pb2_grpc

SERVICE_NAME = "specserve.v1.Coordinator"
RETRY_AFTER_S = 1


@dataclass
class _Call:
    """One Generate/GenerateStream call: its span, final status and request."""

    traced_span: Any = None  # the coordinator.generate span; None when tracing is off
    code: grpc.StatusCode = grpc.StatusCode.OK
    message: str = ""
    job: Request | None = None
    accounted: bool = False  # metrics and span done (``_finish`` ran)

    @property
    def span(self) -> Any:
        """The span, or a non-recording one when the call is not traced."""
        return self.traced_span if self.traced_span is not None else telemetry.INVALID_SPAN


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """The public API over the router."""

    def __init__(self, router: Router, max_n: int) -> None:
        self.router = router
        self.max_n = max_n

    def _limits(self) -> Limits:
        return Limits(vocab_size=self.router.reference.info.vocab_size, max_context=self.router.max_context,
                      max_n=self.max_n)

    async def _abort(self, context: grpc.aio.ServicerContext, call: _Call, code: grpc.StatusCode,
                     message: str) -> None:
        call.code, call.message = code, message
        self._finish(call, None)  # before the status goes out: a client that saw it finds the call in the metrics
        await context.abort(code, message)

    async def _submit(self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
                      stream: bool, call: _Call) -> Request:
        try:
            # off the event loop: a long text prompt takes a while to tokenize, and other calls stream meanwhile
            spec = await asyncio.to_thread(validate_request, request, self._limits(), self.router.codec)
        except InvalidRequest as error:
            await self._abort(context, call, grpc.StatusCode.INVALID_ARGUMENT, str(error))
        call.span.set_attributes({
            "gen_ai.request.max_tokens": spec.max_new_tokens, "gen_ai.request.temperature": spec.sampling.temperature,
            "gen_ai.request.top_p": spec.sampling.top_p, "gen_ai.request.top_k": spec.sampling.top_k,
            "specserve.n": spec.n, "gen_ai.usage.input_tokens": len(spec.prompt_token_ids)})
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        try:
            call.job = self.router.submit(spec, stream=stream, deadline=deadline, span=call.traced_span)
            return call.job
        except QueueFull as error:
            context.set_trailing_metadata((("retry-after", str(RETRY_AFTER_S)),))
            await self._abort(context, call, grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{error} (retry-after: {RETRY_AFTER_S}s)")

    def _begin(self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
               stream: bool) -> _Call:
        """Open the request's coordinator.generate span (under the client's propagated context)."""
        span = None
        if telemetry.enabled():
            model = self.router.reference.info.model_name if self.router.reference else ""
            span = telemetry.start_span("coordinator.generate",
                                        parent=telemetry.extract_context(context.invocation_metadata()),
                                        kind=telemetry.SpanKind.SERVER,
                                        attributes={"gen_ai.request.model": model, "specserve.stream": stream})
        return _Call(span)

    def _finish(self, call: _Call, error: BaseException | None) -> None:
        """Account the call in the metrics and close its span with usage and status (once per call)."""
        if call.accounted:
            return
        call.accounted = True
        if isinstance(error, asyncio.CancelledError | GeneratorExit) and call.code == grpc.StatusCode.OK:
            call.code, call.message = grpc.StatusCode.CANCELLED, "cancelled by the client"
        elif error is not None and call.code == grpc.StatusCode.OK:
            call.code, call.message = grpc.StatusCode.UNKNOWN, f"{type(error).__name__}: {error}"
        job = call.job
        usage = job.usage if job is not None else None
        self.router.metrics.request_done(call.code, usage,
                                         job.timing() if job is not None and job.done.is_set() else None)
        if call.traced_span is None:
            return
        if usage is not None:
            call.span.set_attributes({"gen_ai.usage.output_tokens": usage.completion_tokens,
                                      "specserve.rounds": usage.rounds,
                                      "specserve.tokens_proposed": usage.draft_tokens_proposed,
                                      "specserve.tokens_accepted": usage.draft_tokens_accepted})
        if call.code != grpc.StatusCode.OK:
            call.span.set_status(telemetry.Status(telemetry.StatusCode.ERROR, f"{call.code.name}: {call.message}"))
        call.span.end()

    async def Generate(self, request: coordinator_pb2.GenerateRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> coordinator_pb2.GenerateResponse:
        """All ``n`` completions of the request with their usage and timing, once the last one finishes;
        INVALID_ARGUMENT for bad requests, RESOURCE_EXHAUSTED (with a retry-after) when every queue is full."""
        call = self._begin(request, context, stream=False)
        error: BaseException | None = None
        try:
            job = await self._submit(request, context, stream=False, call=call)
            try:
                await job.done.wait()
            except asyncio.CancelledError:
                self.router.cancel(job)
                raise
            if job.error is not None:
                await self._abort(context, call, *job.error)
            completions = [coordinator_pb2.Completion(index=s.index, token_ids=s.token_ids, text=s.text,
                                                      finish_reason=s.finish_reason, token_logprobs=s.logprobs,
                                                      cumulative_logprob=sum(s.logprobs)) for s in job.samples]
            return coordinator_pb2.GenerateResponse(completions=completions, usage=job.usage, timing=job.timing())
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._finish(call, error)

    async def GenerateStream(self, request: coordinator_pb2.GenerateRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> AsyncIterator[coordinator_pb2.GenerateChunk]:
        """The request's tokens as they are accepted, per sample; the last message carries usage and timing;
        errors as ``Generate``; cancelling the stream releases the request's sequences."""
        call = self._begin(request, context, stream=True)
        error: BaseException | None = None
        try:
            job = await self._submit(request, context, stream=True, call=call)
            try:
                while (chunk := await job.chunks.get()) is not None:
                    yield chunk
            finally:  # a client that left mid-send closes the stream with GeneratorExit, not CancelledError
                if not job.done.is_set():
                    self.router.cancel(job)
            if job.error is not None:
                await self._abort(context, call, *job.error)
            yield coordinator_pb2.GenerateChunk(usage=job.usage, timing=job.timing())
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._finish(call, error)
