"""Prometheus metrics scraped over HTTP from each server agree with the responses served."""

from __future__ import annotations

import time

import grpc
import pytest
from conftest import coordinator_stub
from prometheus_scrape import scrape, value
from tiny_models import FIXED_K

from deployment.processes import Deployment
from specserve.v1 import coordinator_pb2


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory):
    """A deployment with --metrics-port on every server, three good requests and one bad one."""
    logs = tmp_path_factory.mktemp("metrics-logs")
    with Deployment(str(checkpoints["llama"]), str(checkpoints["llama_draft"]), log_dir=logs,
                    metrics=True, draft_args=FIXED_K) as deployment:
        stub = coordinator_stub(deployment.coordinator_address)
        responses = []
        for n, max_new, temperature in ((1, 12, 0.0), (2, 9, 1.0), (3, 17, 0.0)):
            request = coordinator_pb2.GenerateRequest(prompt="import os\n", n=n, max_new_tokens=max_new,
                                                      temperature=temperature, seed=n, ignore_eos=True)
            responses.append(stub.Generate(request, timeout=120))
        with pytest.raises(grpc.RpcError) as bad:
            stub.Generate(coordinator_pb2.GenerateRequest(prompt="x", n=0), timeout=30)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        ports = {role: server.metrics_port for role, server in deployment.servers.items()}
        coordinator = scrape(ports["coordinator"])
        models = {}
        deadline = time.monotonic() + 10
        while True:  # the batch is released right after the last request; give the Release a moment
            models = {role: scrape(ports[role]) for role in ("draft", "target")}
            if all(value(m, "specserve_sequences") == 0 and value(m, "specserve_sessions") == 0
                   for m in models.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        yield responses, coordinator, models


def test_coordinator_counters_match_responses(served):
    responses, metrics, _ = served
    usage = [r.usage for r in responses]
    assert value(metrics, "specserve_requests_total", status="OK") == 3
    assert value(metrics, "specserve_requests_total", status="INVALID_ARGUMENT") == 1
    assert value(metrics, "specserve_errors_total", code="INVALID_ARGUMENT") == 1
    assert value(metrics, "specserve_generated_tokens_total") == sum(u.completion_tokens for u in usage) == 12 + 18 + 51
    assert value(metrics, "specserve_prompt_tokens_total") == sum(u.prompt_tokens for u in usage) > 0
    assert value(metrics, "specserve_cached_prompt_tokens_total") == 0  # every prompt is shorter than one cache block
    assert value(metrics, "specserve_routed_requests_total", reason="least_loaded") == 3
    assert value(metrics, "specserve_routed_prefix_tokens_total") == 0
    proposed = sum(u.draft_tokens_proposed for u in usage)
    accepted = sum(u.draft_tokens_accepted for u in usage)
    assert proposed > 0
    assert value(metrics, "specserve_draft_tokens_proposed_total") == proposed
    assert value(metrics, "specserve_draft_tokens_accepted_total") == accepted
    assert value(metrics, "specserve_acceptance_rate") == pytest.approx(accepted / proposed)
    # Requests ran one after another: every round served exactly one of them.
    assert value(metrics, "specserve_rounds_total") == sum(u.rounds for u in usage)
    assert value(metrics, "specserve_batch_sequences_count") == sum(u.rounds for u in usage)
    assert value(metrics, "specserve_queue_depth") == 0
    for histogram in ("time_to_first_token", "request_duration", "queue_wait", "inter_token_latency"):
        assert value(metrics, f"specserve_{histogram}_seconds_count") == 3, histogram
    total = sum(r.timing.total_s for r in responses)
    assert value(metrics, "specserve_request_duration_seconds_sum") == pytest.approx(total, rel=1e-6)


def test_model_service_metrics(served):
    responses, coordinator, models = served
    rounds = value(coordinator, "specserve_rounds_total")
    # The sampled request's batch runs rounds without the draft (the speculation gate measures them), plain or
    # verifying the coordinator's lookup tokens: no Propose in those.
    plain = value(coordinator, "specserve_plain_rounds_total")
    lookup = value(coordinator, "specserve_lookup_rounds_total")
    assert 0 < plain + lookup < rounds
    assert plain == sum(r.usage.plain_rounds for r in responses)
    assert lookup == sum(r.usage.lookup_rounds for r in responses)
    for name in ("proposed", "accepted"):
        assert value(coordinator, f"specserve_lookup_tokens_{name}_total") == sum(
            getattr(r.usage, f"lookup_tokens_{name}") for r in responses)
    for role, method, calls in (("draft", "Propose", rounds - plain - lookup), ("target", "Verify", rounds)):
        metrics = models[role]
        assert value(metrics, "specserve_model_calls_total", method=method, code="OK") == calls, role
        assert value(metrics, "specserve_model_calls_total", method="Prefill", code="OK") == len(responses), role
        assert value(metrics, "specserve_forward_seconds_count", method=method.lower()) == calls, role
        assert value(metrics, "specserve_forward_seconds_count", method="prefill") == len(responses), role
        assert value(metrics, "specserve_model_calls_total", method="Release", code="OK") >= 1, role
        # Every batch was released after its request: nothing held any more.
        assert value(metrics, "specserve_sessions") == 0, role
        assert value(metrics, "specserve_sequences") == 0, role
        assert value(metrics, "specserve_kv_cache_bytes") == 0, role
