"""Continuous batching and the speculative round loop of one target replica.

One running batch, held by id on the target replica and on one draft replica pinned to it. At every
round boundary waiting requests join (their prompts prefilled once per group on both services) and
finished sequences leave (released through the next call). Each round: the draft proposes k tokens for
every live sequence, the target verifies them all in one pass, accepted tokens stream to the clients.

Failures: a failing draft is dropped from the batch (plain decoding on the target continues, greedy
output unchanged) and re-joins when healthy, catching up on the tokens it missed. A failing target
fails its running requests with UNAVAILABLE, or hands them to another replica when nothing reached the
client yet; queued requests wait for the target to come back.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from coordinator.draft_length import DraftLength
from coordinator.lookup import LookupProposer, lookup_proposal
from coordinator.model_clients import ModelEndpoint
from coordinator.replicas import ReplicaPool
from coordinator.request import Request
from coordinator.speculation_gate import ROUND_KINDS, request_progress
from engine.prompt_lookup import DEFAULT_NGRAM_SIZES
from serving import telemetry
from serving.metrics import CoordinatorMetrics
from serving.model_service import sampling_to_proto
from specserve.v1 import model_pb2

log = logging.getLogger(__name__)

RETRYABLE_PREFILL = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND)
CLIENT_ERRORS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
# A prefill that times out is retried with twice the timeout, at most this many tries in all: long prompts
# queued on the target's compute thread finish on a later try, and a --model-timeout shorter than one
# prefill fails the request with a message naming the flag instead of retrying until the client's deadline.
MAX_PREFILL_TRIES = 4


def _status_code(error: BaseException) -> grpc.StatusCode:
    """The gRPC status of a failed model call (INTERNAL for anything that is not an RPC error)."""
    return error.code() if isinstance(error, grpc.aio.AioRpcError) else grpc.StatusCode.INTERNAL


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; the client should retry later."""


@dataclass
class SchedulerConfig:
    """Batching bounds and model-call settings."""

    max_batch_sequences: int = 64
    max_batch_tokens: int = 0  # prompt + max_new_tokens summed over the batch's sequences; 0 = unbounded
    max_queue: int = 256
    model_timeout_s: float = 60.0
    draft_timeout_s: float = 10.0
    release_timeout_s: float = 5.0
    probe_period_s: float = 1.0
    prompt_lookup: tuple[int, int] | None = DEFAULT_NGRAM_SIZES  # n-gram sizes of draft-free rounds' lookup; None: off


class Scheduler:
    """Owns one target replica's running batch and drives its rounds."""

    def __init__(self, target: ModelEndpoint, drafts: ReplicaPool | None, draft_length: DraftLength,
                 config: SchedulerConfig, reroute: Callable[[Request, Scheduler], bool],
                 metrics: CoordinatorMetrics | None = None) -> None:
        self.target = target
        self.metrics = metrics if metrics is not None else CoordinatorMetrics()
        self.drafts = drafts
        self.draft_length = draft_length
        self.config = config
        self.reroute = reroute
        self.removed = False
        self.draft: ModelEndpoint | None = None
        self.lookup = LookupProposer(config.prompt_lookup) if config.prompt_lookup else None
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._samples: dict[int, tuple[Request, object]] = {}
        self._updates: dict[int, tuple[int, int]] = {}
        self._catch_up: dict[int, list[int]] = {}
        self._draft_release: list[int] = []  # finished sequences the pinned draft still holds (its next Propose)
        self._held: set[int] = set()
        self._batch_tokens = 0
        self._admitting = 0  # sequences whose prefill is in flight
        self._wake = asyncio.Event()
        self._last_probe = 0.0
        self.batch_id = uuid.uuid4().hex

    # -- public ---------------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        """Requests waiting to join the batch."""
        return len(self._waiting)

    @property
    def load(self) -> int:
        """Sequences running plus sequences waiting: what the router balances."""
        return len(self._held) + self._admitting + sum(r.spec.n for r in self._waiting)

    def enqueue(self, request: Request, front: bool = False) -> None:
        """Queue a request; raises QueueFull when the waiting queue is at its bound."""
        if not front and len(self._waiting) >= self.config.max_queue:
            raise QueueFull(f"the coordinator queue is full ({self.config.max_queue} requests waiting); "
                            "retry after a short backoff")
        if front:
            self._waiting.appendleft(request)
        else:
            self._waiting.append(request)
        request.queue_started()
        self._wake.set()

    def cancel(self, request: Request) -> None:
        """Stop a request (client cancelled or deadline passed): its sequences leave at the next round."""
        if request in self._waiting:
            self._waiting.remove(request)
        for sample in request.samples:
            sample.finish("cancelled")
        request.complete((grpc.StatusCode.CANCELLED, "cancelled by the client"))
        self._wake.set()

    def retire(self) -> list[Request]:
        """Stop after the current round (the replica left); returns the queued requests to re-place."""
        self.removed = True
        self._wake.set()
        waiting, self._waiting = list(self._waiting), deque()
        return waiting

    async def run(self) -> None:
        """The round loop; runs until the replica is removed or the task is cancelled."""
        while not self.removed:
            if not self.target.healthy:
                await asyncio.sleep(self.config.probe_period_s / 2)
                await self.target.check_health()
                continue
            self._running = [r for r in self._running if not r.done.is_set()]
            if not self._live():
                await self._end_batch()  # nothing live: release everything the services hold, fresh batch
                if not self._waiting:  # no await between this check and clear(): no lost wake-up
                    self._wake.clear()
                    await self._wake.wait()
                    continue
            await self._admit()
            if self._live():
                await self._rejoin_draft()
                await self._round()
            await asyncio.sleep(0)
        await self._fail_running((grpc.StatusCode.UNAVAILABLE, f"target replica {self.target.address} was removed"))

    # -- batch membership -----------------------------------------------------------------------------
    def _live(self) -> list[int]:
        return [s.sequence_id for r in self._running for s in r.samples if s.sequence_id in self._held]

    @staticmethod
    def _tokens(request: Request) -> int:
        return request.spec.n * (len(request.spec.prompt_token_ids) + request.spec.max_new_tokens)

    def _fits(self, request: Request, seats: int, tokens: int, first: bool) -> bool:
        if first:  # an empty batch always takes the next request (validation bounds n and lengths)
            return True
        token_cap = self.config.max_batch_tokens
        return request.spec.n <= seats and (not token_cap or self._tokens(request) <= tokens)

    async def _admit(self) -> None:
        admitted: list[Request] = []
        seats = self.config.max_batch_sequences - len(self._held)
        tokens = self.config.max_batch_tokens - self._batch_tokens
        while self._waiting and self._fits(self._waiting[0], seats, tokens, not (self._held or admitted)):
            request = self._waiting.popleft()
            request.queue_ended()
            seats -= request.spec.n
            tokens -= self._tokens(request)
            admitted.append(request)
        if not admitted:
            return
        if not self._held and self.draft is None and self.drafts is not None:
            self._pin_draft(self.drafts.least_loaded())
        self._admitting = sum(r.spec.n for r in admitted)
        try:
            await asyncio.gather(*(self._prefill(r) for r in admitted))
        finally:
            self._admitting = 0

    def _pin_draft(self, draft: ModelEndpoint | None) -> None:
        self.draft = draft
        if draft is not None:
            draft.batches += 1

    def _group_spec(self, request: Request, sequence_ids: list[int]) -> model_pb2.GroupSpec:
        spec = request.spec
        return model_pb2.GroupSpec(group_id=request.group_id, prompt_token_ids=spec.prompt_token_ids,
                                   sequence_ids=sequence_ids, sampling=sampling_to_proto(spec.sampling),
                                   max_new_tokens=spec.max_new_tokens, logprobs=spec.logprobs)

    def _timeout(self, request: Request, limit: float) -> float:
        if request.deadline is None:
            return limit
        return max(0.01, min(limit, request.deadline - time.monotonic()))

    def _prefill_limit(self, request: Request) -> float:
        return self.config.model_timeout_s * 2 ** request.prefill_timeouts

    async def _prefill(self, request: Request) -> None:
        span = telemetry.start_span("coordinator.prefill", parent=request.span, attributes={
            "specserve.batch_id": self.batch_id, "specserve.groups": 1, "specserve.sequences": request.spec.n,
            "specserve.prompt_tokens": len(request.spec.prompt_token_ids)})
        try:
            await self._prefill_group(request, span)
        finally:
            span.end()

    async def _prefill_group(self, request: Request, span: telemetry.Span) -> None:
        ids = [s.sequence_id for s in request.samples]
        prefill = model_pb2.PrefillRequest(batch_id=self.batch_id, groups=[self._group_spec(request, ids)])
        metadata = telemetry.inject_metadata(span)
        calls = [self.target.stub.Prefill(prefill, timeout=self._timeout(request, self._prefill_limit(request)),
                                          metadata=metadata)]
        draft = self.draft
        if draft is not None:
            span.set_attribute("specserve.with_draft", True)
            calls.append(draft.stub.Prefill(prefill, timeout=self._timeout(request, self.config.draft_timeout_s),
                                            metadata=metadata))
        target_result, *draft_result = await asyncio.gather(*calls, return_exceptions=True)
        if isinstance(target_result, BaseException):
            span.set_status(telemetry.error_status(target_result))
            cleanup = []
            if draft_result and not isinstance(draft_result[0], BaseException):
                cleanup.append(self._release_quietly(draft, ids))
            if _status_code(target_result) not in CLIENT_ERRORS:  # it may have run there after all
                cleanup.append(self._release_quietly(self.target, ids))
            await asyncio.gather(*cleanup)
            self._prefill_failed(request, target_result)
            return
        span.set_attribute("specserve.kv_bytes", target_result.kv_bytes)
        request.usage.cached_prompt_tokens = sum(c.tokens for c in target_result.cached_tokens
                                                 if c.group_id == request.group_id)
        span.set_attribute("specserve.cached_prompt_tokens", request.usage.cached_prompt_tokens)
        if draft_result and isinstance(draft_result[0], BaseException):
            self._drop_draft(draft_result[0])
        request.admitted = time.monotonic()
        by_id = {s.sequence_id: s for s in request.samples}
        if self.lookup is not None:
            first = {t.sequence_id: t.token_id for t in target_result.first_tokens}
            self.lookup.start(request.spec.prompt_token_ids, first)
        for token in target_result.first_tokens:
            sample = by_id[token.sequence_id]
            self._samples[token.sequence_id] = (request, sample)
            self._updates[token.sequence_id] = (0, token.token_id)
            self._held.add(token.sequence_id)
            request.record(sample, sample.extend([token.token_id],
                                                 [token.logprob] if token.HasField("logprob") else None))
        self._batch_tokens += self._tokens(request)
        self._running.append(request)
        if request.finished:
            request.complete()

    def _prefill_failed(self, request: Request, error: BaseException) -> None:
        code = _status_code(error)
        if request.done.is_set():
            return
        client_gone = request.deadline is not None and time.monotonic() > request.deadline
        if code in CLIENT_ERRORS:
            request.complete((code, error.details() or code.name))
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED and not client_gone \
                and request.prefill_timeouts + 1 >= MAX_PREFILL_TRIES:
            request.complete((code, (
                f"target {self.target.address} did not finish the prefill of this {len(request.spec.prompt_token_ids)}"
                f"-token prompt in {MAX_PREFILL_TRIES} tries (the last one waited {self._prefill_limit(request):g}s):"
                f" raise the coordinator's --model-timeout ({self.config.model_timeout_s:g}s, doubled on each"
                " retry) or send a shorter prompt")))
        elif code in RETRYABLE_PREFILL and not client_gone:
            log.warning("target %s failed a prefill (%s); the request waits for it", self.target.address, code.name)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                request.prefill_timeouts += 1
            self.target.healthy = False
            if not self.reroute(request, self):
                self.enqueue(request, front=True)
        else:
            request.complete(self._status(error, self.target))

    def _drop_draft(self, error: BaseException) -> None:
        if self.draft is not None:
            log.warning("draft %s failed (%s); batch continues on the target alone", self.draft.address, error)
            self.draft.healthy = False
            self.draft.batches -= 1
            self.draft = None
            self._catch_up.clear()
            self._draft_release.clear()

    async def _rejoin_draft(self) -> None:
        """While the batch runs without a draft, probe the drafts; re-prefill a healthy one and let it
        catch up on the tokens each live sequence generated meanwhile (in its next Propose)."""
        if self.drafts is None or self.draft is not None:
            return
        now = time.monotonic()
        if now - self._last_probe < self.config.probe_period_s:
            return
        self._last_probe = now
        await asyncio.gather(*(e.check_health() for e in self.drafts.endpoints.values()))
        draft = self.drafts.least_loaded()
        if draft is None:
            return
        await self._release_quietly(draft, [])
        self._draft_release.clear()
        groups = []
        for request in self._running:
            ids = [s.sequence_id for s in request.samples if s.sequence_id in self._held]
            if ids:
                groups.append(self._group_spec(request, ids))
        try:
            await draft.stub.Prefill(model_pb2.PrefillRequest(batch_id=self.batch_id, groups=groups),
                                     timeout=self.config.draft_timeout_s)
        except grpc.aio.AioRpcError as error:
            draft.healthy = False
            log.info("draft %s not ready to re-join: %s", draft.address, error.code().name)
            return
        self._pin_draft(draft)
        for sid in self._held:
            tokens = self._samples[sid][1].token_ids
            self._updates[sid] = (0, tokens[-1])
            self._catch_up[sid] = tokens[:-1]
        log.info("draft %s re-joined batch %s", draft.address, self.batch_id)

    async def _release_quietly(self, endpoint: ModelEndpoint | None, sequence_ids: list[int]) -> None:
        if endpoint is None:
            return
        try:
            await endpoint.stub.Release(model_pb2.ReleaseRequest(batch_id=self.batch_id, sequence_ids=sequence_ids),
                                        timeout=self.config.release_timeout_s)
        except grpc.aio.AioRpcError as error:
            log.info("release on %s %s failed: %s", endpoint.role, endpoint.address, error.code().name)

    async def _end_batch(self) -> None:
        """Release the whole batch on the target and its draft, unpin the draft, start a fresh batch (with a
        fresh draft length)."""
        if not self._held and not self._samples and self.draft is None:
            return
        await asyncio.gather(self._release_quietly(self.target, []), self._release_quietly(self.draft, []))
        if self.draft is not None:
            self.draft.batches -= 1
            self.draft = None
        self._samples.clear()
        self._updates.clear()
        self._catch_up.clear()
        self._draft_release.clear()
        self._held.clear()
        if self.lookup is not None:
            self.lookup.clear()
        self._batch_tokens = 0
        self._running = [r for r in self._running if not r.done.is_set()]
        self.draft_length.reset()  # the next batch may be another workload: its k and gate start afresh
        self.batch_id = uuid.uuid4().hex

    @staticmethod
    def _status(error: BaseException, endpoint: ModelEndpoint) -> tuple[grpc.StatusCode, str]:
        if isinstance(error, grpc.aio.AioRpcError):
            code = error.code()
            if code in CLIENT_ERRORS:
                return code, error.details() or code.name
            return grpc.StatusCode.UNAVAILABLE, (f"{endpoint.role} replica {endpoint.address} failed: "
                                                 f"{code.name}: {error.details()}")
        return grpc.StatusCode.INTERNAL, f"{endpoint.role} call failed: {error}"

    # -- one round ------------------------------------------------------------------------------------
    async def _round(self) -> None:
        finished_ids = [sid for sid in self._held if self._samples[sid][1].finished]
        self._held.difference_update(finished_ids)
        if self.lookup is not None:
            self.lookup.forget(finished_ids)
        if self.draft is not None:  # released there in the next draft round, however many rounds skip it
            self._draft_release.extend(finished_ids)
        left: dict[int, Request] = {}  # requests whose last sequences finished (several may end one request)
        for sid in finished_ids:
            request, _ = self._samples.pop(sid)
            self._updates.pop(sid, None)
            self._catch_up.pop(sid, None)
            if all(s.sequence_id not in self._held for s in request.samples):
                left[id(request)] = request
        self._batch_tokens -= sum(self._tokens(request) for request in left.values())
        live = self._live()
        draft = self.draft
        in_round = [r for r in self._running if any(s.sequence_id in self._held for s in r.samples)]
        sampled = any(not r.spec.sampling.greedy for r in in_round)  # the batch's mix, for the speculation gate
        # The kinds of round this batch can run. A greedy batch with lookup does not judge plain rounds: a
        # lookup round that finds nothing is one, and where lookup finds tokens it beats them (greedy lookup
        # tokens are mostly accepted, and a request's score cuts them where not), so a third kind would only
        # add wrong choices made on the gate's first, noisy figures (docs/benchmarks.md, run K).
        available = (draft is not None, self.lookup is not None, self.lookup is None or sampled)
        kinds = [kind for kind, ok in zip(ROUND_KINDS, available, strict=True) if ok]
        kind, k = self.draft_length.for_round(kinds, sampled, len(live))
        # A round serves many requests: a root span of its own, linked to the span of each request in it.
        traced = [r.span for r in in_round if r.span is not None]
        span = telemetry.start_span("coordinator.round", links=traced, attributes={
            "specserve.batch_id": self.batch_id, "specserve.groups": len(traced),
            "specserve.sequences": len(live), "specserve.draft_len": k})
        try:
            await self._speculate(span, live, finished_ids, draft, kind, k, sampled)
        finally:
            span.end()

    async def _speculate(self, span: telemetry.Span, live: list[int], finished_ids: list[int],
                         draft: ModelEndpoint | None, kind: str, k: int, sampled: bool) -> None:
        metadata = telemetry.inject_metadata(span)
        # what lookup finds is scored in every round; a draft-free round verifies it
        looked_up = {sid: self.lookup.propose(sid, self._lookup_limit(sid)) for sid in live} if self.lookup else {}
        proposals: list[model_pb2.Proposal] = []
        start = time.monotonic()
        skip_draft = draft is not None and kind != "draft"  # the draft hears of this round's tokens next time
        if kind == "draft":
            updates = [model_pb2.SequenceUpdate(sequence_id=sid, accepted_len=self._updates[sid][0],
                                                next_token_id=self._updates[sid][1],
                                                catch_up_token_ids=self._catch_up.pop(sid, []))
                       for sid in live]
            propose = model_pb2.ProposeRequest(batch_id=self.batch_id, draft_len=k, updates=updates,
                                               release_sequence_ids=self._draft_release)
            self._draft_release = []
            try:
                reply = await draft.stub.Propose(propose, timeout=self.config.draft_timeout_s, metadata=metadata)
                proposals = list(reply.proposals)
            except grpc.aio.AioRpcError as error:
                span.add_event("draft dropped", {"grpc.status_code": error.code().name})
                self._drop_draft(error)
                kind, k = ("lookup" if self.lookup is not None else "plain"), 0
                start = time.monotonic()  # the round that runs instead is timed alone
        chosen = kind  # the gate judges the kind it chose: a lookup round that finds nothing is part of its cost
        if kind != "draft":
            proposals = [self._lookup_proposal(sid, looked_up.get(sid, []) if kind == "lookup" else []) for sid in live]
            # what runs (metrics, usage): a lookup round that found nothing is a plain step
            kind = "lookup" if any(p.token_ids for p in proposals) else "plain"
        verify = model_pb2.VerifyRequest(batch_id=self.batch_id, proposals=proposals,
                                         release_sequence_ids=finished_ids)
        try:
            verified = await self.target.stub.Verify(verify, timeout=self.config.model_timeout_s, metadata=metadata)
        except grpc.aio.AioRpcError as error:
            span.set_status(telemetry.error_status(error))
            self.target.healthy = False
            await self._fail_running(self._status(error, self.target))
            return
        tokens_proposed, tokens_accepted = self._apply(proposals, verified.verdicts, kind, k, skip_draft,
                                                       time.monotonic() - start, sampled, chosen)
        self.metrics.round_done(len(live), tokens_proposed, tokens_accepted, kind)
        span.set_attributes({"specserve.draft_len": k, "specserve.round_kind": kind,
                             "specserve.tokens_proposed": tokens_proposed,
                             "specserve.tokens_accepted": tokens_accepted, "specserve.kv_bytes": verified.kv_bytes})

    def _lookup_limit(self, sequence_id: int) -> int:
        """The most lookup tokens worth verifying for the sequence: up to the draft length's maximum, and short
        of its last token (the verify adds one of its own)."""
        sample = self._samples[sequence_id][1]
        return max(0, min(self.draft_length.maximum, sample.max_new_tokens - len(sample.token_ids) - 1))

    def _lookup_proposal(self, sequence_id: int, tokens: list[int]) -> model_pb2.Proposal:
        """What a draft-free round verifies for the sequence: its lookup tokens (none: one plain decode step)."""
        return lookup_proposal(sequence_id, tokens, self._samples[sequence_id][0].spec.sampling.greedy)

    def _apply(self, proposals: list[model_pb2.Proposal], verdicts: list[model_pb2.Verdict], kind: str, k: int,
               skipped_draft: bool, seconds: float, sampled: bool, chosen: str) -> tuple[int, int]:
        """Extend each sample by its verdict, complete finished requests and account the round (of ``kind``,
        with draft length ``k``; ``seconds`` long, of the batch's mix ``sampled``) in the usage, and in the draft
        length and its gate as a round of the ``chosen`` kind; returns the round's (tokens proposed, accepted)
        over its verdicts. After a round that
        ``skipped_draft``, each sequence's update still answers its last proposal and the tokens confirmed
        since queue as catch-up."""
        proposed = {p.sequence_id: list(p.token_ids) for p in proposals}
        wire = {p.sequence_id: p.ByteSize() for p in proposals} if kind == "draft" else {}
        tokens_proposed = tokens_accepted = 0
        accepted_lens, proposal_lens = [], []
        lengths: dict[int, tuple[list[int], list[int], list[bool]]] = {}  # per request: its samples' lengths
        # before and after the round, and whether they finished in it (the gate's credit, ``request_progress``)
        in_round: dict[int, Request] = {}
        with_lookup: set[int] = set()  # the requests of which a sequence verified lookup tokens
        for verdict in verdicts:
            request, sample = self._samples[verdict.sequence_id]
            tokens = proposed[verdict.sequence_id]
            confirmed = tokens[: verdict.accepted_len] + [verdict.next_token_id]
            accepted_lens.append(verdict.accepted_len)
            proposal_lens.append(len(tokens))
            if skipped_draft:
                answered, previous = self._updates[verdict.sequence_id]
                self._catch_up.setdefault(verdict.sequence_id, []).extend([previous, *confirmed[:-1]])
                self._updates[verdict.sequence_id] = (answered, verdict.next_token_id)
            else:
                self._updates[verdict.sequence_id] = (verdict.accepted_len, verdict.next_token_id)
            if self.lookup is not None:
                self.lookup.confirm(verdict.sequence_id, confirmed)
            usage = request.usage
            if kind == "draft":
                usage.draft_tokens_proposed += len(tokens)
                usage.draft_tokens_accepted += verdict.accepted_len
                usage.draft_proposal_bytes += wire[verdict.sequence_id]
            else:
                usage.lookup_tokens_proposed += len(tokens)
                usage.lookup_tokens_accepted += verdict.accepted_len
            tokens_proposed += len(tokens)
            tokens_accepted += verdict.accepted_len
            in_round[id(request)] = request
            if tokens and kind != "draft":
                with_lookup.add(id(request))
            before = len(sample.token_ids)
            delta = sample.extend(confirmed, list(verdict.logprobs) or None)
            request.record(sample, delta)
            around = lengths.setdefault(id(request), ([], [], []))
            around[0].append(before)
            around[1].append(len(sample.token_ids))
            around[2].append(sample.finished)
        for key, request in in_round.items():
            request.usage.rounds += 1
            request.usage.lookup_rounds += key in with_lookup
            request.usage.plain_rounds += kind != "draft" and key not in with_lookup
        for request in self._running:
            if request.finished:
                request.complete()
        progress = sum(request_progress(*around) for around in lengths.values())
        self.draft_length.update(k, accepted_lens, seconds, proposal_lens, sampled, chosen, progress)
        return tokens_proposed, tokens_accepted

    async def _fail_running(self, status: tuple[grpc.StatusCode, str]) -> None:
        """Hand running requests that sent nothing to the client yet to another replica, fail the rest
        with ``status``, and start a fresh batch; queued requests stay queued."""
        if self._running:
            log.error("batch %s failed: %s", self.batch_id, status[1])
        for request in self._running:
            if request.done.is_set():
                continue
            if not request.streamed and self.reroute(request, self):
                continue
            for sample in request.samples:
                sample.finish("error")
            request.complete(status)
        self._running = []
        await self._end_batch()
