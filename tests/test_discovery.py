"""Endpoint discovery: static lists, DNS, Kubernetes EndpointSlices (readiness respected), and
balancing of batches across target replicas."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer
from urllib.parse import parse_qs, urlparse

import grpc
import pytest
from conftest import coordinator_stub, target_replicas
from kubernetes import client
from prometheus_scrape import scrape, value

from coordinator.discovery import DNSDiscovery, KubernetesDiscovery, StaticDiscovery, parse_endpoint_spec
from coordinator.prefix_affinity import PrefixAffinity
from deployment.processes import free_port
from specserve.v1 import coordinator_pb2, model_pb2, model_pb2_grpc


def test_parse_endpoint_specs():
    assert isinstance(parse_endpoint_spec("a:1,b:2"), StaticDiscovery)
    dns = parse_endpoint_spec("dns:///target-headless.ns.svc:50052")
    assert isinstance(dns, DNSDiscovery) and (dns.host, dns.port) == ("target-headless.ns.svc", 50052)
    k8s = parse_endpoint_spec("k8s:///serving/specserve-target:50052")
    assert isinstance(k8s, KubernetesDiscovery)
    assert (k8s.namespace, k8s.service, k8s.port) == ("serving", "specserve-target", 50052)
    for bad in ("", "host-without-port", "dns:///nope", "k8s:///only-namespace:1", "k8s:///ns/svc:port"):
        with pytest.raises(ValueError, match="expected"):
            parse_endpoint_spec(bad)


def test_dns_resolves_every_address():
    addresses = asyncio.run(DNSDiscovery("localhost", 4242).resolve())
    assert "127.0.0.1:4242" in addresses
    assert asyncio.run(DNSDiscovery("no-such-host.invalid", 1).resolve()) == []


class EndpointSliceAPI(BaseHTTPRequestHandler):
    """A loopback stand-in for the Kubernetes API server's EndpointSlice list."""

    requests: list[tuple[str, dict]] = []

    def do_GET(self) -> None:  # noqa: N802
        url = urlparse(self.path)
        EndpointSliceAPI.requests.append((url.path, parse_qs(url.query)))
        body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList", "metadata": {}, "items": [
            {"metadata": {"name": "target-abc"}, "addressType": "IPv4", "endpoints": [
                {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
                {"addresses": ["10.0.0.3"]},
            ]},
            {"metadata": {"name": "target-def"}, "addressType": "IPv4", "endpoints": [
                {"addresses": ["10.0.1.1"], "conditions": {"ready": True}}]},
        ]}
        payload = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        return


def test_kubernetes_endpointslices_respect_readiness():
    server = HTTPServer(("127.0.0.1", 0), EndpointSliceAPI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        configuration = client.Configuration(host=f"http://127.0.0.1:{server.server_port}")
        api = client.DiscoveryV1Api(client.ApiClient(configuration))
        addresses = asyncio.run(KubernetesDiscovery("serving", "specserve-target", 50052, api=api).resolve())
    finally:
        server.shutdown()
    assert addresses == ["10.0.0.1:50052", "10.0.0.3:50052", "10.0.1.1:50052"]
    path, query = EndpointSliceAPI.requests[-1]
    assert path == "/apis/discovery.k8s.io/v1/namespaces/serving/endpointslices"
    assert query["labelSelector"] == ["kubernetes.io/service-name=specserve-target"]


def test_batches_balance_across_target_replicas(checkpoints, tmp_path):
    with target_replicas(checkpoints["llama"], tmp_path, 2, "--max-batch-sequences", "2") as (targets, coordinator):
        stub = coordinator_stub(coordinator.address)
        request = coordinator_pb2.GenerateRequest(prompt_token_ids=[3, 4, 5], n=2, max_new_tokens=300,
                                                  ignore_eos=True)
        seen = [0, 0]
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(stub.Generate, request, timeout=300) for _ in range(2)]
            while not all(f.done() for f in futures):
                for i, server in enumerate(targets):
                    stats = model_pb2_grpc.TargetModelStub(grpc.insecure_channel(server.address)).Stats(
                        model_pb2.StatsRequest(), timeout=10)
                    seen[i] = max(seen[i], stats.sequences)
                time.sleep(0.05)
            outputs = [list(f.result().completions[0].token_ids) for f in futures]
        assert seen == [2, 2], "each replica should have run one of the two batches"
        assert outputs[0] == outputs[1]


def test_prefix_affinity_remembers_leading_blocks_and_forgets_oldest():
    affinity = PrefixAffinity(block_tokens=4, max_blocks=3)
    shared, other = affinity.keys(range(12)), affinity.keys([*range(8), 99, 98, 97, 96, 5])
    assert len(shared) == 3 and shared[:2] == other[:2] and shared[2] != other[2]
    affinity.record("a", shared)
    assert affinity.matched_blocks("a", other) == 2 and affinity.matched_blocks("b", shared) == 0
    affinity.record("a", affinity.keys([7] * 4))  # the bound drops the least recently routed block
    assert affinity.matched_blocks("a", shared) == 0
    affinity.forget("a")
    assert affinity.matched_blocks("a", affinity.keys([7] * 4)) == 0


def test_requests_sharing_a_prefix_go_to_the_replica_that_caches_it(checkpoints, tmp_path):
    """With prefix caches on the targets, a request whose prompt begins like a running one joins that
    replica (within the load slack) instead of the idle one; an unrelated prompt goes to the idle one."""
    shared = list(range(40, 80))  # two 16-token blocks
    metrics_port = free_port()
    with target_replicas(checkpoints["llama"], tmp_path, 2, "--metrics-port", str(metrics_port),
                         target_args=["--prefix-cache-mb", "16"]) as (targets, coordinator):
        stub = coordinator_stub(coordinator.address)

        def cache_stats() -> list[model_pb2.ModelStats]:
            return [model_pb2_grpc.TargetModelStub(grpc.insecure_channel(t.address)).Stats(
                model_pb2.StatsRequest(), timeout=10) for t in targets]

        long_running = stub.GenerateStream(coordinator_pb2.GenerateRequest(
            prompt_token_ids=shared, n=2, max_new_tokens=400, ignore_eos=True), timeout=300)
        next(long_running)
        busy = next(i for i, s in enumerate(cache_stats()) if s.prefix_cache_lookup_tokens)
        joined = stub.Generate(coordinator_pb2.GenerateRequest(
            prompt_token_ids=[*shared, 5, 6], n=2, max_new_tokens=4, ignore_eos=True), timeout=300)
        assert joined.usage.cached_prompt_tokens == 32
        unrelated = stub.Generate(coordinator_pb2.GenerateRequest(
            prompt_token_ids=list(range(100, 140)), n=2, max_new_tokens=4, ignore_eos=True), timeout=300)
        assert unrelated.usage.cached_prompt_tokens == 0
        stats = cache_stats()
        assert stats[busy].prefix_cache_hit_tokens == 32 and stats[busy].prefix_cache_lookup_tokens == 40 + 42
        assert stats[1 - busy].prefix_cache_lookup_tokens == 40, "the unrelated prompt should go to the idle replica"
        routed = scrape(metrics_port)  # the router expected the 32 tokens the busy replica had cached
        assert value(routed, "specserve_routed_requests_total", reason="prefix") == 1
        assert value(routed, "specserve_routed_requests_total", reason="least_loaded") == 2
        assert value(routed, "specserve_routed_prefix_tokens_total") == 32
        assert value(routed, "specserve_cached_prompt_tokens_total") == 32
        assert value(routed, "specserve_prompt_tokens_total") == 42 + 40
        long_running.cancel()
