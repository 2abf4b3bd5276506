"""What the draft and target services share: proto conversion, Info/Prefill/Release, start-up."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import torch

from engine.batch import GroupInput
from engine.checkpoint import load_checkpoint
from engine.device import resolve_device
from engine.errors import ModelLoading
from engine.graphs import graphs_supported
from engine.runtime import ModelRuntime, Prefilled
from engine.sampling import CompactDistribution, SamplingParams
from kernels import backend_for_device
from serving import telemetry
from serving.compute_loop import ComputeLoop
from serving.grpc_server import CallerGone, create_server, grpc_errors, set_serving
from serving.metrics import CallMetricsInterceptor, ModelMetrics, start_metrics_server
from serving.tls import TLSFiles
from specserve.v1 import model_pb2

log = logging.getLogger(__name__)

JANITOR_PERIOD_S = 5.0
SHUTDOWN_GRACE_S = 5.0


def sampling_from_proto(message: model_pb2.SamplingParams) -> SamplingParams:
    """Sampling parameters of a group as the runtime takes them."""
    return SamplingParams(temperature=message.temperature, top_p=message.top_p, top_k=message.top_k,
                          seed=message.seed)


def sampling_to_proto(params: SamplingParams) -> model_pb2.SamplingParams:
    """The wire form of sampling parameters."""
    return model_pb2.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                    seed=params.seed)


def distribution_from_proto(message: model_pb2.DraftDistribution) -> CompactDistribution:
    """A draft distribution from its wire form."""
    return CompactDistribution(token_ids=np.asarray(message.token_ids, dtype=np.int32),
                               probs_fp16=bytes(message.probs_fp16))


def distribution_to_proto(distribution: CompactDistribution) -> model_pb2.DraftDistribution:
    """The wire form of a draft distribution (``distribution_from_proto`` reads back the same one)."""
    return model_pb2.DraftDistribution(token_ids=distribution.token_ids.tolist(), probs_fp16=distribution.probs_fp16)


def group_from_proto(group: model_pb2.GroupSpec) -> GroupInput:
    """A group to prefill, from its wire form."""
    return GroupInput(group_id=group.group_id, prompt_token_ids=list(group.prompt_token_ids),
                      sequence_ids=list(group.sequence_ids), params=sampling_from_proto(group.sampling),
                      max_new_tokens=group.max_new_tokens, logprobs=group.logprobs)


class ModelServicer:
    """Info, Prefill and Release over a runtime that is set once the model has loaded."""

    def __init__(self) -> None:
        self.runtime: Any = None
        # All model work runs on the thread that loads the model and then serves this loop (serve_model): torch
        # keeps one OpenMP thread team per calling thread, and a second team makes every operator pay a wake-up.
        self.compute = ComputeLoop()
        self.metrics = ModelMetrics()
        self.model_attributes: dict[str, Any] = {}

    def set_runtime(self, runtime: ModelRuntime) -> None:
        """Start serving ``runtime``: calls reach it and the metrics gauges read its stats."""
        self.model_attributes = {"gen_ai.request.model": runtime.checkpoint.name}
        self.metrics.track_runtime(runtime.stats)
        self.runtime = runtime

    def _ready(self, context: grpc.ServicerContext) -> Any:
        if self.runtime is None:
            raise ModelLoading("the model is still loading; retry shortly")
        return self.runtime

    @grpc_errors
    def Info(self, request: model_pb2.InfoRequest, context: grpc.ServicerContext) -> model_pb2.ModelInfo:  # noqa: N802
        """The loaded model's identity: name, architecture, vocabulary (with its fingerprint), EOS ids,
        context length and tokenizer; UNAVAILABLE while the model loads."""
        runtime: ModelRuntime = self._ready(context)
        ckpt = runtime.checkpoint
        return model_pb2.ModelInfo(
            model_name=ckpt.name, architecture=ckpt.model.config.architectures[0], vocab_size=ckpt.vocab_size,
            eos_token_ids=ckpt.eos_token_ids, max_context=ckpt.max_context,
            tokenizer_json=ckpt.tokenizer_json(), vocab_fingerprint=ckpt.vocab_fingerprint(),
            attention=runtime.attention, dtype=str(runtime.decoder.dtype).removeprefix("torch."),
            prefix_block_tokens=runtime.prefix_cache.block_tokens if runtime.prefix_cache is not None else 0,
        )

    @grpc_errors
    def Prefill(self, request: model_pb2.PrefillRequest, context: grpc.ServicerContext  # noqa: N802
                ) -> model_pb2.PrefillResponse:
        """Prefill the request's groups into its batch (see ``ModelRuntime.prefill``): INVALID_ARGUMENT for
        bad groups, RESOURCE_EXHAUSTED past the KV budget, with the batch left unchanged either way."""
        runtime: ModelRuntime = self._ready(context)
        attributes = {**self.model_attributes, "specserve.batch_id": request.batch_id,
                      "specserve.groups": len(request.groups),
                      "specserve.sequences": sum(len(g.sequence_ids) for g in request.groups),
                      "specserve.prompt_tokens": sum(len(g.prompt_token_ids) for g in request.groups)}
        with telemetry.server_span(f"{runtime.role}.prefill", context, attributes) as span, \
                self.metrics.forward.labels("prefill").time():
            done = self.compute.call(prefill_for_caller, runtime, request, context)
            kv_bytes = runtime.kv_bytes_in_use()
            span.set_attribute("specserve.kv_bytes", kv_bytes)
            span.set_attribute("specserve.cached_prompt_tokens", sum(done.cached_tokens.values()))
        return model_pb2.PrefillResponse(
            first_tokens=[model_pb2.SequenceToken(sequence_id=s, token_id=t, logprob=done.first_logprobs.get(s))
                          for s, t in done.first_tokens.items()],
            kv_bytes=kv_bytes,
            cached_tokens=[model_pb2.GroupCachedTokens(group_id=g, tokens=n) for g, n in done.cached_tokens.items()],
        )

    @grpc_errors
    def Stats(self, request: model_pb2.StatsRequest, context: grpc.ServicerContext  # noqa: N802
              ) -> model_pb2.ModelStats:
        """The runtime's current counters: batches, sequences, KV bytes, prefix cache."""
        runtime: ModelRuntime = self._ready(context)
        return model_pb2.ModelStats(**runtime.stats())

    @grpc_errors
    def Release(self, request: model_pb2.ReleaseRequest, context: grpc.ServicerContext  # noqa: N802
                ) -> model_pb2.ReleaseResponse:
        """Drop the listed sequences of a batch (none listed: the whole batch) and free their KV."""
        runtime: ModelRuntime = self._ready(context)
        released = self.compute.call(runtime.release, request.batch_id, list(request.sequence_ids))
        return model_pb2.ReleaseResponse(released_sequences=released)


def prefill_for_caller(runtime: ModelRuntime, request: model_pb2.PrefillRequest, context: grpc.ServicerContext
                       ) -> Prefilled:
    """Prefill ``request`` unless its caller has gone (deadline passed or cancelled) by the time the compute
    thread gets to it; if the caller goes while it runs, release its sequences again. Raises CallerGone when
    nothing was kept, so a batch never holds sequences its coordinator was told had failed."""
    if not context.is_active():
        raise CallerGone("the caller gave up before the prefill ran; nothing was kept")
    done = runtime.prefill(request.batch_id, [group_from_proto(g) for g in request.groups])
    if not context.is_active():
        runtime.release(request.batch_id, [sid for g in request.groups for sid in g.sequence_ids])
        raise CallerGone("the caller gave up while the prefill ran; its sequences were released")
    return done


def runtime_options(args: Any) -> tuple[torch.device, dict[str, Any]]:
    """The device and the ``ModelRuntime`` keyword arguments that ``serve draft|target`` flags ask for.

    Raises ValueError with a message naming the flag when they cannot run here (``--device cuda`` without
    CUDA, ``--attention-backend triton`` on CPU, ``--cuda-graphs on`` where steps cannot be captured).
    """
    device = resolve_device(args.device)
    backend = backend_for_device(args.attention_backend, device)
    graphs = {"auto": None, "on": True, "off": False}[args.cuda_graphs]
    if graphs and not graphs_supported(device, args.attention, backend):
        raise ValueError(f"--cuda-graphs on needs --device cuda and the triton backend or --attention standard "
                         f"(got {device}, {args.attention}, {backend})")
    options = {
        "attention": args.attention, "attention_backend": backend, "cuda_graphs": graphs,
        "kv_budget_bytes": int(args.kv_budget_mb * 2**20) if args.kv_budget_mb else None,
        "session_ttl_s": args.session_ttl,
        "prefix_cache_bytes": int(args.prefix_cache_mb * 2**20),
    }
    if hasattr(args, "prompt_lookup"):  # serve draft
        options["prompt_lookup"] = args.prompt_lookup
        options["confidence_floor"] = args.confidence_floor
    return device, options


def serve_model(servicer: ModelServicer, add_to_server: Callable[[Any, grpc.Server], None], service_name: str,
                runtime_factory: Callable[..., ModelRuntime], args: Any) -> int:
    """Bind the port, report NOT_SERVING while the model loads, then serve until terminated.

    The calling thread loads the model and then runs every model call (``servicer.compute``); SIGTERM/SIGINT
    report NOT_SERVING and let calls in flight finish for up to SHUTDOWN_GRACE_S seconds. Tracing follows the
    ``OTEL_*`` environment (see serving.telemetry); Prometheus metrics are served on ``--metrics-port`` when it
    is non-zero. Flags that cannot run on this machine end the process with a one-line message before anything
    is bound.
    """
    try:
        device, options = runtime_options(args)
    except ValueError as error:
        raise SystemExit(f"specserve serve {getattr(runtime_factory, 'role', 'model')}: {error}") from None
    telemetry.setup_tracing(getattr(runtime_factory, "role", "model"))
    tls = TLSFiles(args.tls_cert, args.tls_key, args.tls_ca, args.tls_client_auth)
    server, health_servicer, port = create_server([service_name], args.host, args.port, tls,
                                                  interceptors=[CallMetricsInterceptor(servicer.metrics)])
    if start_metrics_server(servicer.metrics.registry, args.host, getattr(args, "metrics_port", 0)):
        log.info("metrics on http://%s:%d/metrics", args.host, args.metrics_port)
    add_to_server(servicer, server)
    server.start()
    log.info("%s listening on %s:%d, loading %s", service_name, args.host, port, args.model)
    # loaded on this thread, which then runs every call (serving.compute_loop: one OpenMP team per process)
    checkpoint = load_checkpoint(args.model, args.dtype, device)
    runtime = runtime_factory(checkpoint, **options)
    servicer.set_runtime(runtime)
    set_serving(health_servicer, [service_name], True)
    log.info("%s serving %s on %s:%d (%s, %s, %s attention, CUDA graphs %s)", service_name, checkpoint.name,
             args.host, port, device, runtime.decoder.dtype, runtime.attention_backend,
             "on" if runtime.cuda_graphs else "off")

    def expire_idle() -> None:
        for batch_id in runtime.expire_idle():
            log.info("expired idle batch %s", batch_id)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: servicer.compute.stop())
    servicer.compute.serve(expire_idle, JANITOR_PERIOD_S)  # until SIGTERM/SIGINT
    log.info("%s shutting down: NOT_SERVING, draining for up to %.0fs", service_name, SHUTDOWN_GRACE_S)
    set_serving(health_servicer, [service_name], False)
    stopped = server.stop(SHUTDOWN_GRACE_S)
    # calls in flight still run here until they are done or the grace has passed
    threading.Thread(target=lambda: (stopped.wait(), servicer.compute.stop()), daemon=True).start()
    servicer.compute.serve(expire_idle, JANITOR_PERIOD_S)
    servicer.compute.close()
    return 0
