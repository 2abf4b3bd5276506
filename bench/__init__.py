"""Benchmarks. Each sub-command module exposes add_arguments(parser) and run(args)."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS: dict[str, tuple[str, str]] = {
    "attention": ("bench.attention", "one attention call: bifurcated vs standard"),
    "decode": ("bench.decode", "one decode step of an MHA model at long context"),
    "e2e": ("bench.e2e", "end-to-end generation: batched, HF generate/assisted, BASS, BASS over gRPC"),
    "tracing": ("bench.tracing", "request latency with span export on vs off"),
    "load": ("bench.load", "concurrent streaming clients against a live deployment"),
    "prefix": ("bench.prefix", "requests sharing a long system prompt: prefix cache on vs off, TTFT"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register one sub-parser per benchmark."""
    sub = parser.add_subparsers(dest="benchmark", required=True)
    for name, (module_name, help_text) in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        bench_parser = sub.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(bench_parser)
        bench_parser.set_defaults(bench_handler=module.run)


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark."""
    return int(args.bench_handler(args) or 0)
