"""The live replicas of one role (draft or target), kept in step with discovery."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from coordinator.discovery import Discovery
from coordinator.model_clients import ModelEndpoint, connect
from serving.tls import TLSFiles

log = logging.getLogger(__name__)

CONNECT_WAIT_S = 5.0


class ReplicaPool:
    """Connected endpoints of one role; ``refresh`` adds new replicas and drops vanished ones."""

    def __init__(self, role: str, discovery: Discovery, tls: TLSFiles,
                 accept: Callable[[ModelEndpoint], bool] = lambda endpoint: True) -> None:
        self.role = role
        self.discovery = discovery
        self.tls = tls
        self.accept = accept
        self.endpoints: dict[str, ModelEndpoint] = {}

    async def refresh(self) -> tuple[list[ModelEndpoint], list[ModelEndpoint]]:
        """Re-resolve; connect to new addresses (skipping ones not ready yet). Returns (added, removed)."""
        addresses = set(await self.discovery.resolve())
        removed = [self.endpoints.pop(a) for a in list(self.endpoints) if a not in addresses]
        added = []
        for address in sorted(addresses - set(self.endpoints)):
            try:
                endpoint = await connect(address, self.role, self.tls, CONNECT_WAIT_S)
            except TimeoutError as error:
                log.info("%s", error)
                continue
            if self.accept(endpoint):
                self.endpoints[address] = endpoint
                added.append(endpoint)
            else:
                await endpoint.close()
        for endpoint in removed:
            endpoint.healthy = False
            log.warning("%s replica %s left the endpoint list", self.role, endpoint.address)
        return added, removed

    async def wait_for_one(self, timeout_s: float) -> None:
        """Refresh until at least one replica is connected; raise TimeoutError after ``timeout_s``."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self.endpoints:
            await self.refresh()
            if self.endpoints:
                return
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"no {self.role} replica became ready within {timeout_s:.0f}s")
            await asyncio.sleep(0.5)

    def least_loaded(self) -> ModelEndpoint | None:
        """The healthy replica with the fewest running batches (None when none is healthy)."""
        healthy = [e for e in self.endpoints.values() if e.healthy]
        return min(healthy, key=lambda e: (e.batches, e.address)) if healthy else None
