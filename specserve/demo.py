"""Start draft, target and coordinator as separate processes on loopback, run one multi-sample
generation with the default model pair, print the completions, acceptance and tokens/s."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from specserve.generate import print_response
from specserve.grpc_server import open_channel
from specserve.model_pair import add_model_pair_arguments, resolve_model_pair
from specserve.processes import Deployment
from specserve.tls import TLSFiles
from specserve.v1 import coordinator_pb2, coordinator_pb2_grpc

DEFAULT_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def add_workload_arguments(parser: argparse.ArgumentParser, max_new_tokens: int = 64, temperature: float = 0.8,
                           top_p: float = 0.95, seed: int = 1, optional_draft: bool = False) -> None:
    """The demo workload's flags (models, prompt, n, length, sampling), shared by demo, trace and benchmarks."""
    add_model_pair_arguments(parser, optional_draft=optional_draft)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--temperature", type=float, default=temperature)
    parser.add_argument("--top-p", type=float, default=top_p)
    parser.add_argument("--seed", type=int, default=seed)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``specserve demo``."""
    add_workload_arguments(parser)
    parser.add_argument("--attention", default="bifurcated", choices=["bifurcated", "standard"])


def run(args: argparse.Namespace) -> int:
    """Run the demo end to end and shut everything down; returns 0 on success."""
    resolve_model_pair(args)
    with tempfile.TemporaryDirectory() as logs:
        print(f"starting draft, target and coordinator (logs in {logs}) ...", flush=True)
        deployment = Deployment(args.target_model, args.draft_model, model_args=["--attention", args.attention],
                                log_dir=Path(logs))
        with deployment:
            stub = coordinator_pb2_grpc.CoordinatorStub(open_channel(deployment.coordinator_address, TLSFiles()))
            request = coordinator_pb2.GenerateRequest(
                prompt=args.prompt, n=args.n, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_p=args.top_p, seed=args.seed)
            started = time.perf_counter()
            response = stub.Generate(request, timeout=600)
            elapsed = time.perf_counter() - started
            print_response(response, args.prompt)
            tokens = response.usage.completion_tokens
            print(f"--- {tokens} tokens in {elapsed:.2f}s: {tokens / elapsed:.1f} tokens/s "
                  f"({args.n} samples, {args.attention} attention)")
    return 0
