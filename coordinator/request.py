"""A client request in flight: its samples, usage, timing, and the events its handler waits on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from coordinator.completion import Delta, SampleOutput
from coordinator.text import TextCodec
from coordinator.validation import GenerationSpec
from serving import telemetry
from specserve.v1 import coordinator_pb2


@dataclass
class Request:
    """One Generate/GenerateStream call: n samples of one prompt (a group)."""

    spec: GenerationSpec
    group_id: int
    samples: list[SampleOutput]
    stream: bool
    deadline: float | None = None  # time.monotonic() after which the client gave up
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    usage: coordinator_pb2.Usage = field(default_factory=coordinator_pb2.Usage)
    error: tuple[grpc.StatusCode, str] | None = None
    arrived: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    first_token: float | None = None
    finished_at: float | None = None
    streamed: bool = False
    attempts: int = 0
    prefill_timeouts: int = 0  # prefills of this request that ran past their model timeout
    scheduler: Any = None  # the Scheduler the request is queued on or running in
    span: Any = None  # its coordinator.generate span (rounds link to it); None when not traced
    queue_span: Any = None  # its open coordinator.queue_wait span while it waits for a batch
    _last_token: dict[int, float] = field(default_factory=dict)
    _gap_sum: float = 0.0
    _gap_count: int = 0

    @property
    def finished(self) -> bool:
        """True when every sample has finished."""
        return all(s.finished for s in self.samples)

    def record(self, sample: SampleOutput, delta: Delta) -> None:
        """Account a sample's new tokens (timing) and queue a stream chunk for them."""
        now = time.monotonic()
        if delta.token_ids:
            if self.first_token is None:
                self.first_token = now
            previous = self._last_token.get(sample.index)
            if previous is not None:
                # Tokens accepted in one round arrive together: the gap is spread over them.
                self._gap_sum += now - previous
                self._gap_count += len(delta.token_ids)
            self._last_token[sample.index] = now
        if self.stream and (delta.token_ids or delta.finish_reason):
            self.streamed = True
            self.chunks.put_nowait(coordinator_pb2.GenerateChunk(
                index=sample.index, token_ids=delta.token_ids, text=sample.take_text(),
                finish_reason=delta.finish_reason, token_logprobs=delta.logprobs))

    def timing(self) -> coordinator_pb2.Timing:
        """Queue wait, time to first token, mean inter-token latency and total time, in seconds."""
        end = self.finished_at or time.monotonic()
        return coordinator_pb2.Timing(
            queue_wait_s=(self.admitted or end) - self.arrived,
            time_to_first_token_s=(self.first_token or end) - self.arrived,
            inter_token_latency_s=self._gap_sum / self._gap_count if self._gap_count else 0.0,
            total_s=end - self.arrived,
        )

    def queue_started(self) -> None:
        """Open a coordinator.queue_wait span under the request span (when traced and none is open)."""
        if self.span is not None and self.queue_span is None:
            self.queue_span = telemetry.start_span("coordinator.queue_wait", parent=self.span,
                                                   attributes={"specserve.attempt": self.attempts})

    def queue_ended(self) -> None:
        """Close the open coordinator.queue_wait span, if any."""
        if self.queue_span is not None:
            self.queue_span.end()
            self.queue_span = None

    def complete(self, error: tuple[grpc.StatusCode, str] | None = None) -> None:
        """Mark the request done (with an error status, or successfully); idempotent."""
        if self.done.is_set():
            return
        self.queue_ended()
        self.error = error
        self.finished_at = time.monotonic()
        self.usage.prompt_tokens = len(self.spec.prompt_token_ids)
        self.usage.completion_tokens = sum(len(s.token_ids) for s in self.samples)
        self.done.set()
        if self.stream:
            self.chunks.put_nowait(None)

    def restart(self, new_samples: Callable[[], list[SampleOutput]]) -> None:
        """Forget all progress (nothing reached the client yet) so another replica can run it again."""
        self.samples = new_samples()
        self.usage = coordinator_pb2.Usage()
        self.admitted = self.first_token = None
        self._last_token.clear()
        self._gap_sum, self._gap_count = 0.0, 0
        self.attempts += 1


def new_samples(spec: GenerationSpec, next_id: Callable[[], int], eos_token_ids: frozenset[int],
                codec: TextCodec) -> list[SampleOutput]:
    """Fresh outputs for the n samples of a request, each with a new sequence id."""
    eos = frozenset() if spec.ignore_eos else eos_token_ids
    return [SampleOutput(index=i, sequence_id=next_id(), max_new_tokens=spec.max_new_tokens, eos_token_ids=eos,
                         stop=spec.stop, codec=codec) for i in range(spec.n)]
