"""Where the model replicas are: a static list, DNS of a headless Service, or Kubernetes EndpointSlices.

Endpoint specs (``--target`` / ``--draft``):
- ``host:port[,host:port...]`` — a static list;
- ``dns:///HOST:PORT`` — every address HOST resolves to (a headless Service has one per ready pod);
- ``k8s:///NAMESPACE/SERVICE:PORT`` — ready endpoints of the Service's EndpointSlices, read with the
  Kubernetes API (in-cluster credentials, else the local kubeconfig).
"""

from __future__ import annotations

import asyncio
import socket
from abc import ABC, abstractmethod
from typing import Any


class Discovery(ABC):
    """Resolves an endpoint spec to the current list of host:port addresses."""

    @abstractmethod
    async def resolve(self) -> list[str]:
        """The addresses now, sorted; may be empty."""


class StaticDiscovery(Discovery):
    """A fixed list of addresses."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = sorted(addresses)

    async def resolve(self) -> list[str]:
        return list(self.addresses)


class DNSDiscovery(Discovery):
    """All IPv4/IPv6 addresses of a host name (a headless Service's pods)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port

    async def resolve(self) -> list[str]:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror:
            return []
        addresses = {f"[{info[4][0]}]:{self.port}" if info[0] == socket.AF_INET6 else f"{info[4][0]}:{self.port}"
                     for info in infos}
        return sorted(addresses)


class KubernetesDiscovery(Discovery):
    """Ready endpoints of a Service, from its EndpointSlices (discovery.k8s.io/v1)."""

    def __init__(self, namespace: str, service: str, port: int, api: Any = None) -> None:
        self.namespace, self.service, self.port = namespace, service, port
        self._api = api

    def _client(self) -> Any:
        if self._api is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api = client.DiscoveryV1Api()
        return self._api

    def _list(self) -> list[str]:
        slices = self._client().list_namespaced_endpoint_slice(
            self.namespace, label_selector=f"kubernetes.io/service-name={self.service}")
        addresses = set()
        for endpoint_slice in slices.items:
            for endpoint in endpoint_slice.endpoints or []:
                conditions = endpoint.conditions
                if conditions is not None and conditions.ready is False:
                    continue
                addresses.update(f"{address}:{self.port}" for address in endpoint.addresses or [])
        return sorted(addresses)

    async def resolve(self) -> list[str]:
        return await asyncio.to_thread(self._list)


def parse_endpoint_spec(spec: str) -> Discovery:
    """The Discovery for an endpoint spec; raises ValueError with the accepted forms on a bad spec."""
    forms = "host:port[,host:port...], dns:///HOST:PORT or k8s:///NAMESPACE/SERVICE:PORT"
    if spec.startswith("dns:///"):
        host, _, port = spec.removeprefix("dns:///").rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"bad endpoint spec {spec!r}; expected {forms}")
        return DNSDiscovery(host, int(port))
    if spec.startswith("k8s:///"):
        path, _, port = spec.removeprefix("k8s:///").rpartition(":")
        namespace, _, service = path.partition("/")
        if not (namespace and service and port.isdigit()):
            raise ValueError(f"bad endpoint spec {spec!r}; expected {forms}")
        return KubernetesDiscovery(namespace, service, int(port))
    addresses = [a.strip() for a in spec.split(",") if a.strip()]
    if not addresses or any(not a.rpartition(":")[2].isdigit() for a in addresses):
        raise ValueError(f"bad endpoint spec {spec!r}; expected {forms}")
    return StaticDiscovery(addresses)
