"""32 concurrent clients with mixed n and lengths: all complete, and greedy results are identical to
running each request alone."""

from __future__ import annotations

from conftest import coordinator_stub

from bench.load import request_mix, run_load


def test_32_concurrent_clients_match_requests_run_alone(deployments):
    deployment = deployments("llama", "llama_draft")
    requests = request_mix(32, temperature=0.0)
    result = run_load(deployment.coordinator_address, requests, clients=32)
    assert [o.code for o in result.observations] == ["OK"] * 32
    stub = coordinator_stub(deployment.coordinator_address)
    for request, observation in zip(requests, result.observations, strict=True):
        alone = stub.Generate(request, timeout=120)
        assert {c.index: list(c.token_ids) for c in alone.completions} == observation.tokens
    summary = result.summary()
    assert summary["ok"] == 32 and summary["tokens_per_s"] > 0
    assert summary["latency_p50_s"] <= summary["latency_p99_s"]
