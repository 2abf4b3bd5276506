"""Load test of a live deployment: many concurrent streaming clients with a mix of n and lengths.

Reports throughput (requests/s, tokens/s) and percentiles of end-to-end latency, time to first token
and inter-token latency as the clients observed them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.timing import host_info
from deployment.arguments import add_model_pair_arguments, resolve_model_pair
from deployment.processes import Deployment
from serving.grpc_server import open_channel
from serving.tls import TLSFiles
from specserve.v1 import coordinator_pb2, coordinator_pb2_grpc

PROMPTS = ["def merge_sorted(a, b):\n", "class LRUCache:\n    def __init__(self, capacity):\n",
           "import os\n\ndef walk_files(root):\n    \"\"\"Yield every file below root.\"\"\"\n",
           "def parse_header(line):\n", "    for key, value in items.items():\n"]
MIX_N = (1, 2, 4, 8)
MIX_TOKENS = (16, 32, 64)


def request_mix(count: int, temperature: float, ignore_eos: bool = True) -> list[coordinator_pb2.GenerateRequest]:
    """``count`` requests cycling through prompts, n in MIX_N and lengths in MIX_TOKENS (deterministic)."""
    return [coordinator_pb2.GenerateRequest(
        prompt=PROMPTS[i % len(PROMPTS)], n=MIX_N[i % len(MIX_N)], max_new_tokens=MIX_TOKENS[i % len(MIX_TOKENS)],
        temperature=temperature, seed=i, ignore_eos=ignore_eos) for i in range(count)]


@dataclass
class Observation:
    """What one client saw for one request."""

    latency_s: float
    ttft_s: float
    gaps_s: list[float]
    tokens: dict[int, list[int]]
    code: str = "OK"
    cached_prompt_tokens: int = 0  # from the stream's final Usage


@dataclass
class LoadResult:
    """All observations of a run and its wall time."""

    wall_s: float
    observations: list[Observation] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        """Throughput and p50/p90/p99 of latency, TTFT and inter-token latency (seconds)."""
        ok = [o for o in self.observations if o.code == "OK"]
        tokens = sum(len(t) for o in ok for t in o.tokens.values())
        out: dict[str, float] = {"requests": len(self.observations), "ok": len(ok), "wall_s": self.wall_s,
                                 "requests_per_s": len(ok) / self.wall_s, "tokens_per_s": tokens / self.wall_s}
        series = {"latency": [o.latency_s for o in ok], "ttft": [o.ttft_s for o in ok],
                  "itl": [g for o in ok for g in o.gaps_s]}
        for name, values in series.items():
            if values:
                cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
                out.update({f"{name}_p50_s": cuts[49], f"{name}_p90_s": cuts[89], f"{name}_p99_s": cuts[98]})
        return out


def stream_one(stub: coordinator_pb2_grpc.CoordinatorStub, request: coordinator_pb2.GenerateRequest,
               timeout_s: float) -> Observation:
    """Send one streaming request and time its chunks (an RPC error is recorded in ``code``, not raised)."""
    start = time.perf_counter()
    first = 0.0
    last: dict[int, float] = {}
    gaps: list[float] = []
    tokens: dict[int, list[int]] = {}
    cached = 0
    try:
        for chunk in stub.GenerateStream(request, timeout=timeout_s):
            now = time.perf_counter()
            cached = max(cached, chunk.usage.cached_prompt_tokens)
            if chunk.token_ids:
                first = first or now - start
                if chunk.index in last:
                    gaps.extend([(now - last[chunk.index]) / len(chunk.token_ids)] * len(chunk.token_ids))
                last[chunk.index] = now
                tokens.setdefault(chunk.index, []).extend(chunk.token_ids)
    except grpc.RpcError as error:
        return Observation(time.perf_counter() - start, first, gaps, tokens, error.code().name, cached)
    return Observation(time.perf_counter() - start, first, gaps, tokens, cached_prompt_tokens=cached)


def run_load(address: str, requests: list[coordinator_pb2.GenerateRequest], clients: int,
             tls: TLSFiles | None = None, timeout_s: float = 600.0) -> LoadResult:
    """Run ``requests`` from ``clients`` concurrent clients (each its own channel); observations keep
    the order of ``requests``."""
    observations: list[Observation | None] = [None] * len(requests)
    cursor = iter(range(len(requests)))
    lock = threading.Lock()

    def client() -> None:
        stub = coordinator_pb2_grpc.CoordinatorStub(open_channel(address, tls or TLSFiles()))
        while True:
            with lock:
                index = next(cursor, None)
            if index is None:
                return
            observations[index] = stream_one(stub, requests[index], timeout_s)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return LoadResult(time.perf_counter() - start, [o for o in observations if o is not None])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``specserve bench load``."""
    parser.add_argument("--coordinator", help="HOST:PORT of a running coordinator (else a local deployment starts)")
    add_model_pair_arguments(parser)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--json", help="write the summary as JSON to this path")


def run(args: argparse.Namespace) -> int:
    """Run the load and print a markdown table of the summary."""
    requests = request_mix(args.requests, args.temperature)
    if args.coordinator:
        result = run_load(args.coordinator, requests, args.clients)
    else:
        resolve_model_pair(args)
        with Deployment(args.target_model, args.draft_model) as deployment:
            result = run_load(deployment.coordinator_address, requests, args.clients)
    summary = {**result.summary(), "clients": args.clients, "temperature": args.temperature, "host": host_info()}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    print("| metric | value |\n|---|---|")
    for key, value in summary.items():
        print(f"| {key} | {value:.4g} |" if isinstance(value, float) else f"| {key} | {value} |")
    return 0
