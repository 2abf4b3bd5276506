"""Benchmarks of specserve: kernels, decode steps, end-to-end generation, load, prefix sharing, tracing."""

from __future__ import annotations

# The sub-commands of ``specserve bench``; each module exposes add_arguments(parser) and run(args).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "attention": ("bench.attention", "one attention call: bifurcated vs standard"),
    "decode": ("bench.decode", "one decode step of an MHA model at long context"),
    "e2e": ("bench.e2e", "end-to-end generation: batched, HF generate/assisted, BASS, BASS over gRPC"),
    "tracing": ("bench.tracing", "request latency with span export on vs off"),
    "load": ("bench.load", "concurrent streaming clients against a live deployment"),
    "prefix": ("bench.prefix", "requests sharing a long system prompt: prefix cache on vs off, TTFT"),
    "verify": ("bench.verify", "one target verify against the proposed tokens in it (vs a plain step)"),
}

