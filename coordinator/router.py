"""Routes requests across target replicas: one Scheduler (one running batch) per target replica.

New requests go to the healthy replica with the least load, except that when the targets run a prefix
cache a request goes to the replica that was sent the longest prefix of its prompt, provided that
replica's load is within ``prefix_affinity_slack`` sequences of the least (so requests sharing a system
prompt land in one batch and one cache, and load still spreads). A request whose replica failed before
anything reached the client is retried once on another replica. Discovery runs periodically, adding
schedulers for new target replicas and retiring those of vanished ones.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

from coordinator.draft_length import DraftLength
from coordinator.model_clients import ModelEndpoint, check_compatible
from coordinator.prefix_affinity import PrefixAffinity
from coordinator.replicas import ReplicaPool
from coordinator.request import Request, new_samples
from coordinator.scheduler import QueueFull, Scheduler, SchedulerConfig
from coordinator.text import TextCodec
from coordinator.validation import GenerationSpec
from serving.metrics import CoordinatorMetrics

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 2
DISCOVERY_PERIOD_S = 5.0


class Router:
    """The coordinator's replicas and their schedulers."""

    def __init__(self, targets: ReplicaPool, drafts: ReplicaPool | None, config: SchedulerConfig,
                 draft_length: Callable[[], DraftLength], metrics: CoordinatorMetrics | None = None,
                 prefix_affinity_slack: int = 16) -> None:
        self.targets = targets
        self.prefix_affinity_slack = prefix_affinity_slack
        self.affinity: PrefixAffinity | None = None  # set in start() when the targets cache prefixes
        self.metrics = metrics if metrics is not None else CoordinatorMetrics()
        self.metrics.track_queue_depth(lambda: self.queue_depth)
        self.drafts = drafts
        self.config = config
        self._draft_length = draft_length
        self.schedulers: dict[str, Scheduler] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._ids = itertools.count(1)
        self.reference: ModelEndpoint | None = None
        self.codec = TextCodec("")

    async def start(self, connect_timeout_s: float) -> None:
        """Wait for a target (and a draft when configured), check they pair, start the schedulers."""
        await self.targets.wait_for_one(connect_timeout_s)
        self.reference = next(iter(self.targets.endpoints.values()))
        self.codec = TextCodec(self.reference.info.tokenizer_json)
        if self.reference.info.prefix_block_tokens > 0:
            self.affinity = PrefixAffinity(self.reference.info.prefix_block_tokens)
        self.targets.accept = self._compatible
        if self.drafts is not None:
            self.drafts.accept = self._compatible
            await self.drafts.wait_for_one(connect_timeout_s)
            for draft in self.drafts.endpoints.values():
                check_compatible(draft.info, self.reference.info)
        for target in self.targets.endpoints.values():
            self._add_scheduler(target)
        self._tasks["<discovery>"] = asyncio.create_task(self._discover())

    def _compatible(self, endpoint: ModelEndpoint) -> bool:
        try:
            check_compatible(endpoint.info, self.reference.info)
        except Exception as error:  # noqa: BLE001 - a bad replica is logged and skipped
            log.error("ignoring %s replica %s: %s", endpoint.role, endpoint.address, error)
            return False
        return True

    @property
    def max_context(self) -> int:
        """The shortest context among the connected models."""
        endpoints = list(self.targets.endpoints.values())
        if self.drafts is not None:
            endpoints += list(self.drafts.endpoints.values())
        return min(e.info.max_context for e in endpoints)

    def _add_scheduler(self, target: ModelEndpoint) -> None:
        scheduler = Scheduler(target, self.drafts, self._draft_length(), self.config,
                              self.reroute, self.metrics)
        self.schedulers[target.address] = scheduler
        self._tasks[target.address] = asyncio.create_task(scheduler.run())

    async def _discover(self) -> None:
        while True:
            await asyncio.sleep(DISCOVERY_PERIOD_S)
            try:
                if self.drafts is not None:
                    await self.drafts.refresh()
                added, removed = await self.targets.refresh()
            except Exception as error:  # noqa: BLE001 - discovery errors must not stop serving
                log.warning("endpoint discovery failed: %s", error)
                continue
            for target in added:
                log.info("target replica %s joined", target.address)
                self._add_scheduler(target)
            for target in removed:
                scheduler = self.schedulers.pop(target.address)
                if self.affinity is not None:
                    self.affinity.forget(target.address)
                for request in scheduler.retire():
                    self._place(request, exclude=None)

    def _candidates(self, exclude: Scheduler | None) -> list[Scheduler]:
        schedulers = [s for s in self.schedulers.values() if s is not exclude and not s.removed]
        healthy = [s for s in schedulers if s.target.healthy]
        return sorted(healthy or schedulers, key=lambda s: (s.load, s.target.address))

    def _ranked(self, request: Request, exclude: Scheduler | None
                ) -> tuple[list[tuple[Scheduler, int]], list[int]]:
        """Candidates in the order to try them, each with the leading blocks of the prompt it is expected to
        cache (0 beyond the load slack), and the prompt's block keys (both empty/0 without affinity)."""
        by_load = self._candidates(exclude)
        if self.affinity is None or not by_load:
            return [(s, 0) for s in by_load], []
        keys = self.affinity.keys(request.spec.prompt_token_ids)
        least = by_load[0].load

        def matched(scheduler: Scheduler) -> int:
            near = scheduler.load <= least + self.prefix_affinity_slack
            return self.affinity.matched_blocks(scheduler.target.address, keys) if near else 0

        ranked = [(s, matched(s)) for s in by_load]
        return sorted(ranked, key=lambda c: (-c[1], c[0].load, c[0].target.address)), keys

    def _place(self, request: Request, exclude: Scheduler | None) -> Scheduler:
        ranked, keys = self._ranked(request, exclude)
        for scheduler, blocks in ranked:
            try:
                scheduler.enqueue(request)
                request.scheduler = scheduler
                if self.affinity is not None:
                    self.affinity.record(scheduler.target.address, keys)
                self.metrics.routed_to(blocks * self.affinity.block_tokens if self.affinity is not None else 0)
                return scheduler
            except QueueFull:
                continue
        raise QueueFull(f"every coordinator queue is full ({self.config.max_queue} requests waiting per replica); "
                        "retry after a short backoff")

    def submit(self, spec: GenerationSpec, stream: bool, deadline: float | None, span: object = None) -> Request:
        """Queue a validated request on a healthy replica (least loaded, or holding its prefix); raises QueueFull.

        ``span`` is the request's coordinator.generate span (None when not traced).
        """
        request = Request(spec=spec, group_id=next(self._ids), samples=self._new_samples(spec), stream=stream,
                          deadline=deadline, span=span)
        self._place(request, exclude=None)
        return request

    def _new_samples(self, spec: GenerationSpec) -> list:
        return new_samples(spec, lambda: next(self._ids), frozenset(self.reference.info.eos_token_ids), self.codec)

    def reroute(self, request: Request, failed: Scheduler) -> bool:
        """Restart a request that sent nothing to its client on another healthy replica; False when
        there is none or the request used its attempts."""
        if request.attempts + 1 >= MAX_ATTEMPTS or request.streamed:
            return False
        if (request.deadline is not None and time.monotonic() > request.deadline) or not any(
                s.target.healthy for s in self._candidates(failed)):
            return False
        request.restart(lambda: self._new_samples(request.spec))
        try:
            self._place(request, exclude=failed)
        except QueueFull:
            return False
        log.info("request %d retried on %s", request.group_id, request.scheduler.target.address)
        return True

    def cancel(self, request: Request) -> None:
        """Cancel a request wherever it is queued or running."""
        request.scheduler.cancel(request)

    @property
    def queue_depth(self) -> int:
        """Requests waiting over all replicas."""
        return sum(s.queue_depth for s in self.schedulers.values())

    async def stop(self) -> None:
        """Cancel the schedulers and discovery."""
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
