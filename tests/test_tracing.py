"""One traced request through coordinator, draft and target processes: one trace, correct parent/child
edges across process boundaries, one propose and one verify per round, token counts equal to the usage,
round spans linked to the request, prefill spans counting the prompt tokens read from the prefix caches;
the waterfall names every service."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from conftest import coordinator_stub

from deployment.otlp_receiver import OtlpReceiver
from deployment.processes import Deployment
from serving import telemetry
from specserve.trace import TRACE_ENV, collect, traced_generate
from specserve.v1 import coordinator_pb2
from specserve.waterfall import render_html, render_png

PROMPT = 'def area(radius):\n    """The area of a circle of the given radius."""\n'
SERVICES = {"specserve-client", "specserve-coordinator", "specserve-draft", "specserve-target"}


@pytest.fixture(scope="module")
def traced(checkpoints, tmp_path_factory):
    """A deployment exporting to an in-process receiver, one n=3 sampled request, and its spans."""
    logs = tmp_path_factory.mktemp("tracing-logs")
    with OtlpReceiver() as receiver:
        env = {**TRACE_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
        with Deployment(str(checkpoints["llama"]), str(checkpoints["llama_draft"]), log_dir=logs, env=env,
                        coordinator_args=["--fixed-draft-len", "--draft-len", "3"],
                        # the random draft's top probabilities are 0.03-0.08: proposals of 1 or 2 of the 3
                        draft_args=["--confidence-floor", "0.002"]) as deployment:
            stub = coordinator_stub(deployment.coordinator_address)
            request = coordinator_pb2.GenerateRequest(prompt=PROMPT, n=3, max_new_tokens=20,
                                                      temperature=1.0, seed=5, ignore_eos=True)
            # an untraced request first: the traced one finds the prompt's leading blocks in both prefix caches
            stub.Generate(coordinator_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=1), timeout=120)
            response, trace_id = traced_generate(stub, request, f"127.0.0.1:{receiver.port}", timeout_s=120)
            spans = collect(receiver, trace_id, timeout_s=30)
    return response, trace_id, spans


def one(spans, name):
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{len(found)} {name} spans"
    return found[0]


def test_request_trace_spans_all_services_with_cross_process_parents(traced):
    response, trace_id, spans = traced
    own = [s for s in spans if s.trace_id == trace_id]
    assert {s.service for s in own} == SERVICES  # the prefill path crosses all three processes
    client = one(own, "client.generate")
    generate = one(own, "coordinator.generate")
    assert generate.service == "specserve-coordinator" and generate.parent_span_id == client.span_id
    assert one(own, "coordinator.queue_wait").parent_span_id == generate.span_id
    prefill = one(own, "coordinator.prefill")
    assert prefill.parent_span_id == generate.span_id
    for name, service in (("target.prefill", "specserve-target"), ("draft.prefill", "specserve-draft")):
        span = one(own, name)
        assert span.service == service and span.parent_span_id == prefill.span_id
        assert span.attributes["gen_ai.system"] == "specserve"
        assert span.attributes["gen_ai.request.model"]
        assert span.attributes["specserve.cached_prompt_tokens"] == response.usage.cached_prompt_tokens
    assert response.usage.cached_prompt_tokens >= 16  # at least one 16-token block came from the caches
    assert prefill.attributes["specserve.cached_prompt_tokens"] == response.usage.cached_prompt_tokens
    a = generate.attributes
    assert a["specserve.n"] == 3 and a["gen_ai.request.max_tokens"] == 20
    assert a["gen_ai.request.temperature"] == pytest.approx(1.0) and a["gen_ai.request.top_p"] == pytest.approx(1.0)
    assert a["gen_ai.usage.input_tokens"] == response.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == response.usage.completion_tokens == 60
    assert "gen_ai.request.model" in a and "gen_ai.request.top_k" in a


def test_rounds_link_to_the_request_and_parent_one_propose_and_one_verify(traced):
    response, trace_id, spans = traced
    generate = one([s for s in spans if s.trace_id == trace_id], "coordinator.generate")
    rounds = [s for s in spans if s.name == "coordinator.round"]
    assert len(rounds) == response.usage.rounds > 1
    for round_span in rounds:
        assert (trace_id, generate.span_id) in round_span.links
        assert round_span.trace_id != trace_id and round_span.parent_span_id == ""  # a root of its own
        below = [s for s in spans if s.parent_span_id == round_span.span_id]
        assert Counter(s.name for s in below) == {"draft.propose": 1, "target.verify": 1}
        for child in below:
            assert child.trace_id == round_span.trace_id
            assert child.service == f"specserve-{child.name.split('.')[0]}"
            assert child.attributes["specserve.batch_id"] == round_span.attributes["specserve.batch_id"]
            assert child.attributes["specserve.sequences"] == round_span.attributes["specserve.sequences"]
            assert child.attributes["specserve.kv_bytes"] > 0
        verify = next(s for s in below if s.name == "target.verify")
        assert one([s for s in spans if s.parent_span_id == verify.span_id], "target.accept")
        assert round_span.attributes["specserve.draft_len"] == 3
        assert round_span.attributes["specserve.groups"] == 1


def test_span_token_counts_equal_usage(traced):
    response, _, spans = traced
    usage = response.usage

    def total(name, key):
        return sum(s.attributes[key] for s in spans if s.name == name)

    assert usage.draft_tokens_proposed > 0
    assert total("draft.propose", "specserve.tokens_proposed") == usage.draft_tokens_proposed
    assert total("target.verify", "specserve.tokens_proposed") == usage.draft_tokens_proposed
    assert total("target.verify", "specserve.tokens_accepted") == usage.draft_tokens_accepted
    assert total("coordinator.round", "specserve.tokens_proposed") == usage.draft_tokens_proposed
    assert total("coordinator.round", "specserve.tokens_accepted") == usage.draft_tokens_accepted
    assert 0 <= total("draft.propose", "specserve.prompt_lookup_tokens") <= usage.draft_tokens_proposed
    cut = total("draft.propose", "specserve.proposals_cut_short")
    assert 0 < cut <= total("draft.propose", "specserve.sequences")
    assert usage.draft_tokens_proposed <= 3 * total("draft.propose", "specserve.sequences") - cut


def test_waterfall_names_every_service(traced, tmp_path: Path):
    _, trace_id, spans = traced
    page = render_html(spans, tmp_path / "trace.html", f"trace {trace_id}").read_text()
    for service in SERVICES:
        assert service in page
    assert page.count("class='bar") == len(spans)
    assert "round k=3" in page and "target.verify" in page
    png = render_png(spans, tmp_path / "trace.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tracing_is_off_without_an_endpoint():
    assert not telemetry.tracing_configured({})
    assert telemetry.tracing_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"})
    assert not telemetry.tracing_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:1", "OTEL_SDK_DISABLED": "true"})
    assert not telemetry.tracing_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:1",
                                             "OTEL_TRACES_EXPORTER": "none"})
    if not telemetry.enabled():  # this test process installs no provider: the helpers do nothing
        assert telemetry.inject_metadata() is None
        assert telemetry.inject_metadata(metadata=[("a", "b")]) == (("a", "b"),)
        assert telemetry.start_span("x") is telemetry.INVALID_SPAN
