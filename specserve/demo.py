"""Start draft, target and coordinator as separate processes on loopback, run one multi-sample
generation with the default model pair, print the completions, acceptance and tokens/s."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from deployment.arguments import add_workload_arguments, resolve_model_pair
from deployment.processes import Deployment
from serving.grpc_server import open_channel
from serving.tls import TLSFiles
from specserve.generate import print_response
from specserve.v1 import coordinator_pb2, coordinator_pb2_grpc


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
