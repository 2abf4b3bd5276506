"""Prometheus metrics of the coordinator and the model services (one registry per process).

Each role builds its metrics object at start-up and, when ``--metrics-port`` is non-zero, serves the
registry over HTTP (``/metrics``) with start_metrics_server().
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Latency buckets (seconds) from sub-millisecond CPU steps to multi-minute generations.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)
SEQUENCE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class CoordinatorMetrics:
    """Requests, errors, rounds, draft acceptance, queue and latency of one coordinator."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("specserve_requests", "Generate/GenerateStream calls answered, by final status",
                                ["status"], registry=r)
        self.errors = Counter("specserve_errors", "calls answered with a non-OK status, by code", ["code"],
                              registry=r)
        self.rounds = Counter("specserve_rounds", "decode rounds of a batch (one target Verify each)", registry=r)
        self.plain_rounds = Counter("specserve_plain_rounds",
                                    "rounds that verified no proposed tokens: plain decode steps (no draft call, and "
                                    "the coordinator's prompt lookup found nothing to propose)", registry=r)
        self.lookup_rounds = Counter("specserve_lookup_rounds",
                                     "rounds without a draft call that verified the coordinator's own prompt-lookup "
                                     "tokens (the speculation gate chose a draft-free round, or no draft was "
                                     "reachable)", registry=r)
        self.lookup_proposed = Counter("specserve_lookup_tokens_proposed",
                                       "prompt-lookup tokens the coordinator proposed in rounds without a draft call",
                                       registry=r)
        self.lookup_accepted = Counter("specserve_lookup_tokens_accepted",
                                       "prompt-lookup tokens of the coordinator's that the target accepted", registry=r)
        self.proposed = Counter("specserve_draft_tokens_proposed", "draft tokens proposed to the target",
                                registry=r)
        self.accepted = Counter("specserve_draft_tokens_accepted", "draft tokens the target accepted", registry=r)
        self.generated = Counter("specserve_generated_tokens", "completion tokens generated (all samples)",
                                 registry=r)
        self.prompt_tokens = Counter("specserve_prompt_tokens", "prompt tokens of the requests answered OK",
                                     registry=r)
        self.cached_prompt_tokens = Counter("specserve_cached_prompt_tokens",
                                            "prompt tokens of the requests answered OK whose KV a target found in "
                                            "its prefix cache", registry=r)
        self.routed = Counter("specserve_routed_requests",
                              "requests placed on a target replica, by reason: prefix (the replica was sent a "
                              "leading block of the prompt before) or least_loaded", ["reason"], registry=r)
        self.routed_prefix_tokens = Counter("specserve_routed_prefix_tokens",
                                            "prompt tokens the router expected the chosen replica to hold in its "
                                            "prefix cache (an estimate; compare specserve_cached_prompt_tokens)",
                                            registry=r)
        self.acceptance_rate = Gauge("specserve_acceptance_rate",
                                     "cumulative draft acceptance: accepted / proposed tokens", registry=r)
        self._proposed_total = self._accepted_total = 0
        self.acceptance_rate.set_function(self._acceptance)
        self.batch_sequences = Histogram("specserve_batch_sequences", "live sequences in a round's batch",
                                         buckets=SEQUENCE_BUCKETS, registry=r)
        self.queue_depth = Gauge("specserve_queue_depth", "requests waiting to join a batch", registry=r)
        self.ttft = Histogram("specserve_time_to_first_token_seconds", "request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specserve_inter_token_latency_seconds",
                             "mean gap between consecutive tokens of a sample, one observation per request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("specserve_request_duration_seconds", "request arrival to completion",
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("specserve_queue_wait_seconds", "request arrival to admission into a batch",
                                    buckets=LATENCY_BUCKETS, registry=r)

    def _acceptance(self) -> float:
        return self._accepted_total / self._proposed_total if self._proposed_total else 0.0

    def track_queue_depth(self, depth: Callable[[], int]) -> None:
        """Make the queue-depth gauge read ``depth()`` at every scrape."""
        self.queue_depth.set_function(lambda: float(depth()))

    def round_done(self, sequences: int, proposed: int, accepted: int, kind: str) -> None:
        """Account one round of ``kind`` draft (the draft proposed), lookup (the coordinator proposed, no draft
        call) or plain (nothing proposed): its batch size and the tokens proposed/accepted in it."""
        self.rounds.inc()
        self.batch_sequences.observe(sequences)
        if kind == "plain":
            self.plain_rounds.inc()
        elif kind == "lookup":
            self.lookup_rounds.inc()
            self.lookup_proposed.inc(proposed)
            self.lookup_accepted.inc(accepted)
        elif proposed:
            self.proposed.inc(proposed)
            self.accepted.inc(accepted)
            self._proposed_total += proposed
            self._accepted_total += accepted

    def routed_to(self, matched_tokens: int) -> None:
        """Account one placement on a replica expected to hold ``matched_tokens`` of the prompt (0: by load)."""
        self.routed.labels("prefix" if matched_tokens else "least_loaded").inc()
        self.routed_prefix_tokens.inc(matched_tokens)

    def request_done(self, code: grpc.StatusCode, usage: Any = None, timing: Any = None) -> None:
        """Account a finished call: its status, the tokens it generated, and when OK its prompt tokens (with
        those served from a prefix cache) and latencies. ``usage`` is its coordinator Usage (None: none)."""
        self.requests.labels(code.name).inc()
        if code != grpc.StatusCode.OK:
            self.errors.labels(code.name).inc()
        if usage is not None and usage.completion_tokens:
            self.generated.inc(usage.completion_tokens)
        if usage is not None and code == grpc.StatusCode.OK:
            self.prompt_tokens.inc(usage.prompt_tokens)
            self.cached_prompt_tokens.inc(usage.cached_prompt_tokens)
        if timing is not None and code == grpc.StatusCode.OK:
            self.queue_wait.observe(timing.queue_wait_s)
            self.ttft.observe(timing.time_to_first_token_s)
            self.duration.observe(timing.total_s)
            if timing.inter_token_latency_s > 0:
                self.itl.observe(timing.inter_token_latency_s)


class ModelMetrics:
    """KV cache, held batches and sequences, calls and forward latency of one draft or target service."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.kv_bytes = Gauge("specserve_kv_cache_bytes", "bytes held by the KV caches of all batches", registry=r)
        self.sessions = Gauge("specserve_sessions", "batches held (one per coordinator running batch)", registry=r)
        self.sequences = Gauge("specserve_sequences", "live sequences over all batches", registry=r)
        self.calls = Counter("specserve_model_calls", "model-service RPCs, by method and status code",
                             ["method", "code"], registry=r)
        self.forward = Histogram("specserve_forward_seconds", "runtime time of a call (prefill/propose/verify)",
                                 ["method"], buckets=LATENCY_BUCKETS, registry=r)
        self.prefix_cache_bytes = Gauge("specserve_prefix_cache_bytes", "bytes held by the prefix cache",
                                        registry=r)
        self.prefix_cache_hit_rate = Gauge("specserve_prefix_cache_hit_rate",
                                           "cumulative prompt tokens found in the prefix cache / prompt tokens "
                                           "looked up", registry=r)

    def track_runtime(self, stats: Callable[[], dict[str, int]]) -> None:
        """Make the KV/session/sequence gauges read the runtime's ``stats()`` at every scrape."""
        self.kv_bytes.set_function(lambda: float(stats()["kv_bytes"]))
        self.sessions.set_function(lambda: float(stats()["batches"]))
        self.sequences.set_function(lambda: float(stats()["sequences"]))
        self.prefix_cache_bytes.set_function(lambda: float(stats()["prefix_cache_bytes"]))
        self.prefix_cache_hit_rate.set_function(lambda: _ratio(stats(), "prefix_cache_hit_tokens",
                                                               "prefix_cache_lookup_tokens"))


def _ratio(stats: dict[str, int], numerator: str, denominator: str) -> float:
    return stats[numerator] / stats[denominator] if stats[denominator] else 0.0


class CallMetricsInterceptor(grpc.ServerInterceptor):
    """Counts every unary call of the specserve services by method and final status code."""

    def __init__(self, metrics: ModelMetrics, prefix: str = "/specserve.") -> None:
        self.metrics = metrics
        self.prefix = prefix

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        """Wrap unary-unary handlers of methods under ``prefix``; others pass through unchanged."""
        handler = continuation(handler_call_details)
        method_path: str = handler_call_details.method
        if handler is None or handler.unary_unary is None or not method_path.startswith(self.prefix):
            return handler
        method = method_path.rsplit("/", 1)[-1]
        behavior = handler.unary_unary
        calls = self.metrics.calls

        def counted(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                reply = behavior(request, context)
            except BaseException:
                code = context.code() if hasattr(context, "code") else None
                calls.labels(method, (code or grpc.StatusCode.UNKNOWN).name).inc()
                raise
            code = context.code() if hasattr(context, "code") else None
            calls.labels(method, (code or grpc.StatusCode.OK).name).inc()
            return reply

        return grpc.unary_unary_rpc_method_handler(counted, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve ``registry`` on http://host:port/metrics from a daemon thread when port is non-zero.

    Returns the port (0 when disabled).
    """
    if not port:
        return 0
    start_http_server(port, addr=host, registry=registry)
    return port

