"""Continuous batching and the speculative round loop.

One running batch (held by id on the draft and target services). At every round boundary waiting
requests join (their prompts prefilled once per group on both services) and finished sequences leave
(released on the services through the next call). Each round: the draft proposes k tokens for every
live sequence, the target verifies them all in one pass, accepted tokens stream to the clients.
Without a draft (or while the draft is failing) a round is a plain batched decoding step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections import deque
from dataclasses import dataclass, field

import grpc

from coordinator.completion import Delta, SampleOutput
from coordinator.draft_length import DraftLength
from coordinator.model_clients import ModelEndpoint
from coordinator.text import TextCodec
from coordinator.validation import GenerationSpec
from specserve.model_service import sampling_to_proto
from specserve.v1 import coordinator_pb2, model_pb2

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; the client should retry later."""


@dataclass
class SchedulerConfig:
    """Batching bounds and model-call settings."""

    max_batch_sequences: int = 64
    max_queue: int = 256
    model_timeout_s: float = 60.0
    draft_timeout_s: float = 10.0
    release_timeout_s: float = 5.0


@dataclass
class Request:
    """A client request in flight: its samples, usage, and the events its handler waits on."""

    spec: GenerationSpec
    group_id: int
    samples: list[SampleOutput]
    stream: bool
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    usage: coordinator_pb2.Usage = field(default_factory=coordinator_pb2.Usage)
    error: tuple[grpc.StatusCode, str] | None = None

    @property
    def finished(self) -> bool:
        """True when every sample has finished."""
        return all(s.finished for s in self.samples)

    def emit(self, sample: SampleOutput, delta: Delta) -> None:
        """Queue a stream chunk for a sample's new tokens (streaming requests only)."""
        if self.stream and (delta.token_ids or delta.finish_reason):
            self.chunks.put_nowait(coordinator_pb2.GenerateChunk(
                index=sample.index, token_ids=delta.token_ids, text=delta.text,
                finish_reason=delta.finish_reason))

    def complete(self, error: tuple[grpc.StatusCode, str] | None = None) -> None:
        """Mark the request done (with an error status, or successfully)."""
        if self.done.is_set():
            return
        self.error = error
        self.usage.prompt_tokens = len(self.spec.prompt_token_ids)
        self.usage.completion_tokens = sum(len(s.token_ids) for s in self.samples)
        self.done.set()
        if self.stream:
            self.chunks.put_nowait(None)


class Scheduler:
    """Owns the running batch and drives rounds between the draft and target services."""

    def __init__(self, target: ModelEndpoint, draft: ModelEndpoint | None, codec: TextCodec,
                 draft_length: DraftLength, config: SchedulerConfig) -> None:
        self.target = target
        self.draft = draft
        self.codec = codec
        self.draft_length = draft_length
        self.config = config
        self.eos = frozenset(target.info.eos_token_ids)
        self._ids = itertools.count(1)
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._samples: dict[int, tuple[Request, SampleOutput]] = {}
        self._updates: dict[int, tuple[int, int]] = {}
        self._held: set[int] = set()  # sequence ids the services hold for this batch
        self._wake = asyncio.Event()
        self._new_batch()

    def _new_batch(self) -> None:
        self.batch_id = uuid.uuid4().hex
        self.batch_uses_draft = self.draft is not None

    # -- public ---------------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        """Requests waiting to join the batch."""
        return len(self._waiting)

    @property
    def running_sequences(self) -> int:
        """Sequences in the running batch."""
        return len(self._held)

    def submit(self, spec: GenerationSpec, stream: bool) -> Request:
        """Queue a request; raises QueueFull when the waiting queue is at its bound."""
        if len(self._waiting) >= self.config.max_queue:
            raise QueueFull(f"the coordinator queue is full ({self.config.max_queue} requests waiting); "
                            "retry after a short backoff")
        group_id = next(self._ids)
        samples = [SampleOutput(index=i, sequence_id=next(self._ids), max_new_tokens=spec.max_new_tokens,
                                eos_token_ids=frozenset() if spec.ignore_eos else self.eos, stop=spec.stop,
                                codec=self.codec) for i in range(spec.n)]
        request = Request(spec=spec, group_id=group_id, samples=samples, stream=stream)
        self._waiting.append(request)
        self._wake.set()
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request (client cancelled or deadline passed): its sequences leave at the next round."""
        if request in self._waiting:
            self._waiting.remove(request)
        for sample in request.samples:
            sample.finish("cancelled")
        request.complete((grpc.StatusCode.CANCELLED, "cancelled by the client"))

    async def run(self) -> None:
        """The round loop; runs until cancelled."""
        while True:
            if not self._waiting and not self._running:
                await self._end_batch()
                self._wake.clear()
                await self._wake.wait()
            await self._admit()
            if any(not s.finished for r in self._running for s in r.samples):
                await self._round()
            else:
                self._running = [r for r in self._running if not r.done.is_set()]
                if not self._waiting:
                    await self._end_batch()
            await asyncio.sleep(0)

    # -- batch membership -----------------------------------------------------------------------------
    def _group_spec(self, request: Request) -> model_pb2.GroupSpec:
        spec = request.spec
        return model_pb2.GroupSpec(group_id=request.group_id, prompt_token_ids=spec.prompt_token_ids,
                                   sequence_ids=[s.sequence_id for s in request.samples],
                                   sampling=sampling_to_proto(spec.sampling), max_new_tokens=spec.max_new_tokens)

    async def _admit(self) -> None:
        admitted: list[Request] = []
        seats = self.config.max_batch_sequences - len(self._held)
        while self._waiting and (self._waiting[0].spec.n <= seats or not (self._held or admitted)):
            request = self._waiting.popleft()
            seats -= request.spec.n
            admitted.append(request)
        if admitted:
            await asyncio.gather(*(self._prefill(r) for r in admitted))

    async def _prefill(self, request: Request) -> None:
        prefill = model_pb2.PrefillRequest(batch_id=self.batch_id, groups=[self._group_spec(request)])
        timeout = self.config.model_timeout_s
        calls = [self.target.stub.Prefill(prefill, timeout=timeout)]
        if self.batch_uses_draft:
            calls.append(self.draft.stub.Prefill(prefill, timeout=self.config.draft_timeout_s))
        target_result, *draft_result = await asyncio.gather(*calls, return_exceptions=True)
        if isinstance(target_result, BaseException):
            request.complete(self._status(target_result, self.target))
            if draft_result and not isinstance(draft_result[0], BaseException):
                await self._release_quietly(self.draft, [s.sequence_id for s in request.samples])
            return
        if draft_result and isinstance(draft_result[0], BaseException):
            self._drop_draft(draft_result[0])
        by_id = {s.sequence_id: s for s in request.samples}
        for token in target_result.first_tokens:
            sample = by_id[token.sequence_id]
            self._samples[token.sequence_id] = (request, sample)
            request.emit(sample, sample.extend([token.token_id]))
            self._updates[token.sequence_id] = (0, token.token_id)
            self._held.add(token.sequence_id)
        self._running.append(request)
        self._finish_if_done(request)

    def _finish_if_done(self, request: Request) -> None:
        if request.finished and not request.done.is_set():
            request.complete()

    def _drop_draft(self, error: BaseException) -> None:
        if self.batch_uses_draft:
            log.warning("draft service failed (%s); decoding this batch with the target alone", error)
        self.batch_uses_draft = False

    async def _release_quietly(self, endpoint: ModelEndpoint, sequence_ids: list[int]) -> None:
        try:
            await endpoint.stub.Release(model_pb2.ReleaseRequest(batch_id=self.batch_id, sequence_ids=sequence_ids),
                                        timeout=self.config.release_timeout_s)
        except grpc.aio.AioRpcError as error:
            log.warning("release on %s service failed: %s", endpoint.role, error.details())

    async def _end_batch(self) -> None:
        """Release the whole batch on both services and start a fresh one."""
        if not self._held and not self._samples:
            return
        endpoints = [self.target] + ([self.draft] if self.draft is not None else [])
        await asyncio.gather(*(self._release_quietly(e, []) for e in endpoints))
        self._samples.clear()
        self._updates.clear()
        self._held.clear()
        self._running = [r for r in self._running if not r.done.is_set()]
        self._new_batch()

    @staticmethod
    def _status(error: BaseException, endpoint: ModelEndpoint) -> tuple[grpc.StatusCode, str]:
        if isinstance(error, grpc.aio.AioRpcError):
            code = error.code()
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
                return code, error.details() or code.name
            return grpc.StatusCode.UNAVAILABLE, (f"{endpoint.role} service at {endpoint.address} failed: "
                                                 f"{code.name}: {error.details()}")
        return grpc.StatusCode.INTERNAL, f"{endpoint.role} call failed: {error}"

    # -- one round ------------------------------------------------------------------------------------
    async def _round(self) -> None:
        finished_ids = [sid for sid in self._held if self._samples[sid][1].finished]
        self._held.difference_update(finished_ids)
        for sid in finished_ids:
            self._updates.pop(sid, None)
        live = [sid for r in self._running for s in r.samples
                if (sid := s.sequence_id) in self._held]
        timeout = self.config.model_timeout_s
        k = self.draft_length.k if self.batch_uses_draft else 0
        proposals = [model_pb2.Proposal(sequence_id=sid) for sid in live]
        if self.batch_uses_draft:
            propose = model_pb2.ProposeRequest(
                batch_id=self.batch_id, draft_len=k, release_sequence_ids=finished_ids,
                updates=[model_pb2.SequenceUpdate(sequence_id=sid, accepted_len=self._updates[sid][0],
                                                  next_token_id=self._updates[sid][1]) for sid in live])
            try:
                reply = await self.draft.stub.Propose(propose, timeout=self.config.draft_timeout_s)
                proposals = list(reply.proposals)
            except grpc.aio.AioRpcError as error:
                self._drop_draft(error)
                k = 0
        verify = model_pb2.VerifyRequest(batch_id=self.batch_id, proposals=proposals,
                                         release_sequence_ids=finished_ids)
        try:
            verdicts = (await self.target.stub.Verify(verify, timeout=timeout)).verdicts
        except grpc.aio.AioRpcError as error:
            await self._fail_running(self._status(error, self.target))
            return
        self._apply(proposals, verdicts, k)

    def _apply(self, proposals: list[model_pb2.Proposal], verdicts: list[model_pb2.Verdict], k: int) -> None:
        proposed = {p.sequence_id: list(p.token_ids) for p in proposals}
        accepted_lens = []
        counted: set[int] = set()
        for verdict in verdicts:
            request, sample = self._samples[verdict.sequence_id]
            tokens = proposed[verdict.sequence_id]
            accepted = tokens[: verdict.accepted_len] + [verdict.next_token_id]
            accepted_lens.append(verdict.accepted_len)
            self._updates[verdict.sequence_id] = (verdict.accepted_len, verdict.next_token_id)
            request.usage.draft_tokens_proposed += len(tokens)
            request.usage.draft_tokens_accepted += verdict.accepted_len
            if id(request) not in counted:
                counted.add(id(request))
                request.usage.rounds += 1
            request.emit(sample, sample.extend(accepted))
        for request in self._running:
            self._finish_if_done(request)
        self.draft_length.update(k, accepted_lens)

    async def _fail_running(self, status: tuple[grpc.StatusCode, str]) -> None:
        """Fail every running request with ``status`` and start a fresh batch; waiting requests stay queued."""
        log.error("round failed: %s", status[1])
        for request in self._running:
            for sample in request.samples:
                sample.finish("error")
            request.complete(status)
        await self._end_batch()
