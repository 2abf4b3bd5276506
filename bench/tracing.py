"""Tracing overhead: the same Generate request against two identical deployments, one exporting every
span (OTLP/gRPC to an in-process receiver) and one with tracing off, alternating, medians compared.

Each cycle starts a fresh pair of deployments (which one starts first alternates) so that the luck of
one process's placement does not pass for tracing cost."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.timing import host_info, time_interleaved_samples
from deployment.arguments import add_workload_arguments, resolve_model_pair
from deployment.otlp_receiver import OtlpReceiver
from deployment.processes import Deployment
from serving.grpc_server import open_channel
from serving.tls import TLSFiles
from specserve.v1 import coordinator_pb2, coordinator_pb2_grpc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``specserve bench tracing``."""
    add_workload_arguments(parser)
    parser.add_argument("--repeats", type=int, default=10, help="timed requests per configuration and cycle")
    parser.add_argument("--cycles", type=int, default=3,
                        help="fresh pairs of deployments (start order alternating), against per-process luck")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="also write the results here")


def _caller(address: str, request: coordinator_pb2.GenerateRequest) -> tuple[Callable[[], object], list]:
    stub = coordinator_pb2_grpc.CoordinatorStub(open_channel(address, TLSFiles()))
    responses: list[coordinator_pb2.GenerateResponse] = []
    return (lambda: responses.append(stub.Generate(request, timeout=600))), responses


def run(args: argparse.Namespace) -> int:
    """Measure and print the median request time with tracing off and on, and their ratio."""
    resolve_model_pair(args)
    request = coordinator_pb2.GenerateRequest(prompt=args.prompt, n=args.n, max_new_tokens=args.max_new_tokens,
                                              temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                              ignore_eos=True)
    samples: dict[str, list[float]] = {"off": [], "on": []}
    cycle_ratios: list[float] = []
    responses: dict[str, list] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as logs, OtlpReceiver() as receiver:
        configs = {"off": {"OTEL_SDK_DISABLED": "true"},
                   "on": {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_SDK_DISABLED": "false"}}
        for cycle in range(args.cycles):
            order = ["off", "on"] if cycle % 2 == 0 else ["on", "off"]
            deployments: dict[str, Deployment] = {}
            try:
                for name in order:
                    log_dir = Path(logs) / f"{name}{cycle}"
                    log_dir.mkdir()
                    deployments[name] = Deployment(args.target_model, args.draft_model, log_dir=log_dir,
                                                   env=configs[name]).start()
                calls = {name: _caller(deployments[name].coordinator_address, request) for name in order}
                cycle_samples = time_interleaved_samples({name: call for name, (call, _) in calls.items()},
                                                         args.repeats, args.warmup)
            finally:
                for deployment in deployments.values():
                    deployment.stop()
            for name in order:
                samples[name] += cycle_samples[name]
                responses[name] += calls[name][1]
            cycle_ratios.append(statistics.median(cycle_samples["on"]) / statistics.median(cycle_samples["off"]))
            print(f"cycle {cycle}: on/off {cycle_ratios[-1]:.4f}", flush=True)
        spans = receiver.spans()
    tokens = {name: {tuple(c.token_ids) for r in rs for c in r.completions} for name, rs in responses.items()}
    usage = responses["on"][-1].usage
    medians = {name: statistics.median(s) for name, s in samples.items()}
    ratio = medians["on"] / medians["off"]
    result = {
        "models": {"target": args.target_model, "draft": args.draft_model},
        "request": {"n": args.n, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature},
        "repeats": args.repeats, "cycles": args.cycles, "rounds_per_request": usage.rounds,
        "completion_tokens": usage.completion_tokens, "cycle_ratios": cycle_ratios,
        "median_s": medians, "samples_s": samples, "ratio_on_off": ratio,
        "spans_received": len(spans), "same_outputs": tokens["on"] == tokens["off"], "host": host_info(),
    }
    print(f"tracing off: median {medians['off'] * 1e3:.1f} ms/request, on: {medians['on'] * 1e3:.1f} ms/request "
          f"-> ratio {ratio:.4f} ({(ratio - 1) * 100:+.2f}%)")
    print(f"{args.cycles} cycles x {args.repeats} interleaved requests each, n={args.n}, "
          f"{usage.completion_tokens} tokens, {usage.rounds} rounds per request; {len(spans)} spans received; "
          f"identical outputs: {result['same_outputs']}; per-cycle on/off: "
          + ", ".join(f"{r:.4f}" for r in cycle_ratios))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
