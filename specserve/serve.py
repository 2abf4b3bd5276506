"""Run one specserve server: ``specserve serve draft|target|coordinator``."""

from __future__ import annotations

import argparse
import asyncio
import logging

from coordinator.speculation_gate import DEFAULT_GATE_MODE, GATE_MODES, PROBE_EVERY
from engine.checkpoint import AUTO_DTYPE, DTYPES
from engine.draft import DEFAULT_CONFIDENCE_FLOOR, check_confidence_floor
from engine.prompt_lookup import DEFAULT_NGRAM_SIZES, check_ngram_sizes
from engine.roles import MODEL_ROLES

DEFAULT_PORTS = {"coordinator": 50050, "draft": 50051, "target": 50052}
# Prompt KV kept across requests by default, as vLLM and SGLang do: a hit saves its prefill (23x lower TTFT at
# 4K), a miss costs about 3 % of throughput (docs/benchmarks.md). 1 GiB is ~22k tokens of the default target.
DEFAULT_PREFIX_CACHE_MB = 1024.0


def _common(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to bind (default loopback; 0.0.0.0 to accept remote peers)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORTS[role], help="port to bind (0 = any free port)")
    parser.add_argument("--tls-cert", help="PEM certificate of this server (enables TLS)")
    parser.add_argument("--tls-key", help="PEM private key of this server")
    parser.add_argument("--tls-ca", help="PEM CA this process trusts when calling other services "
                                         "(and, with --tls-client-auth, for client certificates)")
    parser.add_argument("--tls-client-auth", action="store_true",
                        help="require client certificates signed by --tls-ca (mutual TLS)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus metrics over HTTP on this port (0 = off)")


def _model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="local Hugging Face checkpoint directory (default: the default pair's model of this "
                             "role: SmolLM2-135M-Instruct converted once into the cache, or models/smollm2-draft)")
    parser.add_argument("--device", default="auto",
                        help="where the model and its KV caches live: auto (cuda when available), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default=AUTO_DTYPE, choices=[AUTO_DTYPE, *DTYPES],
                        help="weights and KV cache dtype (logits and sampling stay float32); auto: the dtype the "
                             "checkpoint was saved in where the device computes in it natively (CUDA, or bfloat16 "
                             "on a CPU with native bf16), else float32")
    parser.add_argument("--attention", default="bifurcated", choices=["bifurcated", "standard"],
                        help="KV layout: prompt KV shared by a group's samples, or copied per sample")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                        help="bifurcated attention implementation (auto: triton on CUDA, torch on CPU)")
    parser.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"],
                        help="record window steps as CUDA graphs (auto: on CUDA with a capturable attention)")
    parser.add_argument("--kv-budget-mb", type=float, default=0.0,
                        help="refuse new groups (RESOURCE_EXHAUSTED) beyond this much KV cache; 0 = unbounded")
    parser.add_argument("--prefix-cache-mb", type=float, default=DEFAULT_PREFIX_CACHE_MB,
                        help="keep prompt KV of 16-token blocks across requests, at most this much (within "
                             "--kv-budget-mb, evicted least-recently-used); a prompt that begins with cached "
                             "blocks prefills only the rest; 0 = off")
    parser.add_argument("--session-ttl", type=float, default=300.0, help="seconds before an idle batch expires")


def _ngram_sizes(text: str) -> tuple[int, int] | None:
    """``MIN,MAX`` n-gram sizes of a prompt lookup (the draft's or the coordinator's), or None for ``off``."""
    if text.strip().lower() == "off":
        return None
    try:
        low, high = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX (e.g. 2,3) or off, got {text!r}") from None
    try:
        check_ngram_sizes(low, high)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{error} (got {text!r})") from None
    return low, high


def _draft_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-lookup", type=_ngram_sizes, default=DEFAULT_NGRAM_SIZES,
                        metavar="MIN,MAX|off",
                        help="start each proposal with the continuation of the latest earlier occurrence of the "
                             "sequence's last MAX..MIN tokens (prompt lookup; lossless); 'off': the draft model "
                             f"alone (default {','.join(map(str, DEFAULT_NGRAM_SIZES))})")
    parser.add_argument("--confidence-floor", type=_confidence_floor, default=DEFAULT_CONFIDENCE_FLOOR, metavar="P",
                        help="stop a sequence's proposal before the draft's estimate of the chance that the target "
                             "accepts all of it falls below P (per-sequence draft length; lossless); 0: every "
                             f"proposal is the coordinator's k long (default {DEFAULT_CONFIDENCE_FLOOR})")


def _confidence_floor(text: str) -> float:
    """A probability in [0, 1): the draft's confidence floor."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    try:
        check_confidence_floor(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{error} (got {text!r})") from None
    return value


def _coordinator_flags(parser: argparse.ArgumentParser) -> None:
    spec = "host:port[,host:port...], dns:///HOST:PORT (headless Service) or k8s:///NAMESPACE/SERVICE:PORT"
    parser.add_argument("--target", required=True, help=f"target replicas: {spec}")
    parser.add_argument("--draft", help=f"draft replicas ({spec}); without it, batched decoding on the "
                        "target with the coordinator's prompt lookup (--prompt-lookup)")
    parser.add_argument("--max-n", type=int, default=64, help="largest n a request may ask for")
    parser.add_argument("--max-batch-sequences", type=int, default=64, help="sequences in the running batch")
    parser.add_argument("--max-batch-tokens", type=int, default=0,
                        help="bound on prompt + max_new_tokens summed over the batch's sequences (0 = none)")
    parser.add_argument("--auth-token-file", help="file holding the bearer token clients must send")
    parser.add_argument("--max-queue", type=int, default=256, help="waiting requests before RESOURCE_EXHAUSTED")
    parser.add_argument("--prefix-affinity-slack", type=int, default=16,
                        help="when the targets cache prefixes, route a request to the replica holding its prefix "
                             "if that replica's load is within this many sequences of the least loaded one")
    parser.add_argument("--draft-len", type=int, default=4, help="initial draft length k")
    parser.add_argument("--max-draft-len", type=int, default=8, help="upper bound of the adaptive draft length")
    parser.add_argument("--fixed-draft-len", action="store_true", help="keep k = --draft-len every round")
    parser.add_argument("--speculation-gate", nargs="?", const="on", default=DEFAULT_GATE_MODE, choices=GATE_MODES,
                        help="measure the kinds of round (the draft's, the coordinator's prompt lookup, plain "
                             "decode steps) against each other and run the fastest, for batches with a sampled "
                             "sequence (sampled), for every batch (on, the default; the flag alone), or never "
                             "(off: always the draft's, else lookup); docs/design.md")
    parser.add_argument("--prompt-lookup", type=_ngram_sizes, default=DEFAULT_NGRAM_SIZES, metavar="MIN,MAX|off",
                        help="in rounds without a draft call (the gate chose them, no draft is deployed or it is "
                             "down), verify the continuation of the latest earlier occurrence of each sequence's "
                             "last MAX..MIN tokens instead of one plain step (the coordinator's own prompt lookup; "
                             "lossless); 'off': plain decode steps "
                             f"(default {','.join(map(str, DEFAULT_NGRAM_SIZES))})")
    parser.add_argument("--speculation-probe-every", type=int, default=PROBE_EVERY,
                        help="after N rounds one round of another kind (the one measured longest ago) re-measures it; "
                             "probes that confirm the choice double the gap, up to 4N")
    parser.add_argument("--model-timeout", type=float, default=60.0,
                        help="deadline of target calls (s); a timed-out prefill is retried with twice the deadline, "
                             "4 tries in all")
    parser.add_argument("--draft-timeout", type=float, default=10.0,
                        help="deadline of draft calls (s); beyond it the batch continues on the target alone")
    parser.add_argument("--connect-timeout", type=float, default=300.0,
                        help="how long to wait for the model services to become healthy (s)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``serve ROLE`` with the flags of that role."""
    roles = parser.add_subparsers(dest="role", required=True)
    for role in MODEL_ROLES:
        role_parser = roles.add_parser(role, help=f"serve the {role} model")
        _common(role_parser, role)
        _model_flags(role_parser)
        if role == "draft":
            _draft_flags(role_parser)
    coordinator = roles.add_parser("coordinator", help="serve the public Generate API")
    _common(coordinator, "coordinator")
    _coordinator_flags(coordinator)


def run(args: argparse.Namespace) -> int:
    """Serve until terminated."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.role == "coordinator":
        from coordinator.server import serve_coordinator

        return asyncio.run(serve_coordinator(args))
    from engine.default_models import DefaultModelError, default_model
    from serving.model_service import serve_model

    if args.model is None:
        try:
            args.model = str(default_model(args.role))
        except DefaultModelError as error:
            raise SystemExit(str(error)) from error

    if args.role == "draft":
        from draft_service.servicer import SERVICE_NAME, DraftServicer, add_to_server
        from engine.draft import DraftRuntime

        return serve_model(DraftServicer(), add_to_server, SERVICE_NAME, DraftRuntime, args)
    from engine.target import TargetRuntime
    from target_service.servicer import SERVICE_NAME, TargetServicer, add_to_server

    return serve_model(TargetServicer(), add_to_server, SERVICE_NAME, TargetRuntime, args)
