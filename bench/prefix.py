"""Prefix sharing across requests: many requests with n samples each, all beginning with one long system
prompt, served with the target's prefix cache on and off, side by side.

For each system-prompt length L two deployments run at once (a target service and a coordinator each, no
draft): one with ``--prefix-cache-mb``, one with ``--prefix-cache-mb 0``. They are driven alternately, so
drifts of the machine hit both alike. Per L and deployment:

* **TTFT** (``--repeats`` times, median): one request (n samples, one new token) with a fresh variant of the
  system prompt (a miss everywhere), then one with the same system prompt and another question (a hit when
  the cache is on). The hit's speed-up is miss TTFT over hit TTFT in the cached deployment.
* **Throughput** (``--repeats`` times, median, the two orders alternating): ``--requests`` concurrent
  streaming requests, each the system prompt followed by its own question, n samples and
  ``--max-new-tokens`` each; generated tokens per second of wall clock (prefills included) and the median
  TTFT. Before it each deployment serves the system prompt
  once (untimed), as a running service has: with the cache on every timed request is a hit.

Usage's ``cached_prompt_tokens`` of every request is checked: a hit that was not served from the cache (or
a miss that was) fails the benchmark; the share of requests whose greedy samples are identical with the
cache on and off is reported. The model is by default a synthetic-weights Llama
(``bench.synthetic``; random weights do not change the cost of a step); ``--model`` takes a
checkpoint instead. Prompts are held-out stdlib source in the default pair's tokenizer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from bench.arguments import int_list
from bench.load import Observation, run_load, stream_one
from bench.prompts import heldout_files
from bench.synthetic import LlamaShape, save_synthetic_llama
from bench.timing import host_info
from deployment.processes import Deployment
from serving.grpc_server import open_channel
from serving.tls import TLSFiles
from specserve.v1 import coordinator_pb2, coordinator_pb2_grpc

MODES = ("off", "on")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``specserve bench prefix``."""
    parser.add_argument("--system-tokens", type=int_list, default=[1024, 2048, 4096, 8192],
                        help="comma-separated lengths of the shared system prompt")
    parser.add_argument("--requests", type=int, default=16, help="concurrent requests sharing the system prompt")
    parser.add_argument("--n", type=int, default=8, help="samples per request")
    parser.add_argument("--question-tokens", type=int, default=64, help="each request's own tokens after it")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", help="checkpoint directory (default: a synthetic-weights Llama, see --hidden)")
    parser.add_argument("--hidden", type=int, default=LlamaShape.hidden)
    parser.add_argument("--layers", type=int, default=LlamaShape.layers)
    parser.add_argument("--heads", type=int, default=LlamaShape.heads)
    parser.add_argument("--kv-heads", type=int, default=LlamaShape.kv_heads)
    parser.add_argument("--intermediate", type=int, default=LlamaShape.intermediate)
    parser.add_argument("--prefix-cache-mb", type=float, default=2048.0, help="the cached deployment's cache")
    parser.add_argument("--json", help="write the results as JSON to this path")
    parser.add_argument("--plot", help="write a PNG (throughput and TTFT vs system-prompt length) to this path")


def token_corpus(tokenizer_json: Path, count: int) -> list[int]:
    """At least ``count`` token ids of held-out stdlib source, in file order (deterministic)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    ids: list[int] = []
    for _, text in heldout_files():
        ids += tokenizer.encode(text).ids
        if len(ids) >= count:
            return ids
    raise ValueError(f"the held-out corpus has only {len(ids)} tokens, {count} needed")


class PromptSet:
    """System-prompt variants and questions cut from one token corpus: variant ``v`` of length L starts ``v``
    tokens in (so no two variants share a block), questions come from beyond every variant."""

    def __init__(self, corpus: list[int], longest: int, variants: int, questions: int, question_tokens: int
                 ) -> None:
        self.corpus = corpus
        start = longest + variants
        self.questions = [corpus[start + i * question_tokens: start + (i + 1) * question_tokens]
                          for i in range(questions)]

    def system(self, length: int, variant: int) -> list[int]:
        """Variant ``variant`` of the system prompt, ``length`` tokens."""
        return self.corpus[variant: variant + length]


def _request(prompt: Sequence[int], n: int, max_new_tokens: int) -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(prompt_token_ids=list(prompt), n=n, max_new_tokens=max_new_tokens,
                                           ignore_eos=True)


def _checked(observation: Observation, expect_cached: bool, what: str) -> Observation:
    if observation.code != "OK":
        raise RuntimeError(f"{what} failed: {observation.code}")
    if bool(observation.cached_prompt_tokens) != expect_cached:
        raise RuntimeError(f"{what}: {observation.cached_prompt_tokens} prompt tokens came from the cache, "
                           f"expected {'some' if expect_cached else 'none'}")
    return observation


def measure_length(deployments: dict[str, Deployment], prompts: PromptSet, length: int,
                   args: argparse.Namespace) -> dict[str, object]:
    """TTFT of misses and hits and throughput of the shared-prefix load at one system-prompt length."""
    stubs = {mode: coordinator_pb2_grpc.CoordinatorStub(open_channel(d.coordinator_address, TLSFiles()))
             for mode, d in deployments.items()}
    ttft: dict[str, dict[str, list[float]]] = {mode: {"miss": [], "hit": []} for mode in MODES}
    for repeat in range(args.repeats):
        system = prompts.system(length, repeat + 1)
        for mode in MODES:
            for kind, question in (("miss", 0), ("hit", 1)):
                expect = mode == "on" and kind == "hit"
                seen = stream_one(stubs[mode], _request([*system, *prompts.questions[question]], args.n, 1), 600.0)
                ttft[mode][kind].append(_checked(seen, expect, f"{kind} request, cache {mode}").ttft_s)
    shared = prompts.system(length, 0)
    load = [_request([*shared, *prompts.questions[2 + i]], args.n, args.max_new_tokens) for i in range(args.requests)]
    for mode in MODES:  # the system prompt once, as a running service has seen it
        _checked(stream_one(stubs[mode], _request([*shared, *prompts.questions[1]], args.n, 1), 600.0),
                 False, f"warm-up, cache {mode}")
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    outputs: dict[str, list[dict[int, list[int]]]] = {}
    for repeat in range(args.repeats):
        for mode in (MODES if repeat % 2 == 0 else MODES[::-1]):
            result = run_load(deployments[mode].coordinator_address, load, clients=args.requests)
            for index, seen in enumerate(result.observations):
                _checked(seen, mode == "on", f"load request {index}, cache {mode}")
            outputs.setdefault(mode, [o.tokens for o in result.observations])
            summary = result.summary()
            runs[mode].append({"tokens_per_s": summary["tokens_per_s"], "ttft_p50_s": summary["ttft_p50_s"],
                               "wall_s": result.wall_s})
    row: dict[str, object] = {"system_tokens": length}
    for mode in MODES:
        row[f"ttft_miss_s_{mode}"] = statistics.median(ttft[mode]["miss"])
        row[f"ttft_hit_s_{mode}"] = statistics.median(ttft[mode]["hit"])
        for key in ("tokens_per_s", "ttft_p50_s", "wall_s"):
            row[f"{key}_{mode}"] = statistics.median(r[key] for r in runs[mode])
    # Greedy: the same tokens with the cache on and off, up to argmax ties that rounding can flip.
    row["identical_outputs"] = sum(a == b for a, b in zip(outputs["off"], outputs["on"], strict=True)) / len(load)
    row["hit_ttft_speedup"] = row["ttft_miss_s_on"] / row["ttft_hit_s_on"]
    row["throughput_on_over_off"] = row["tokens_per_s_on"] / row["tokens_per_s_off"]
    return row


def run_prefix_bench(args: argparse.Namespace, model: Path) -> dict[str, object]:
    """Every system-prompt length, cache on and off side by side; returns the rows and the setup."""
    longest = max(args.system_tokens)
    corpus = token_corpus(model / "tokenizer.json",
                          longest + args.repeats + 1 + (args.requests + 2) * args.question_tokens)
    prompts = PromptSet(corpus, longest, args.repeats + 1, args.requests + 2, args.question_tokens)
    # Without the cache the requests' long prefills queue on the target's one compute thread: the default
    # 60 s --model-timeout would time the last ones out (and retry them) at 8K tokens on a CPU. Plain decoding
    # (no lookup rounds either): the bench measures the cache, not speculation.
    coordinator_args = ["--max-batch-sequences", str(args.requests * args.n), "--model-timeout", "1800",
                        "--prompt-lookup", "off"]
    rows = []
    for length in args.system_tokens:
        deployments = {
            "off": Deployment(str(model), None, model_args=["--prefix-cache-mb", "0"],
                              coordinator_args=coordinator_args),
            "on": Deployment(str(model), None, model_args=["--prefix-cache-mb", str(args.prefix_cache_mb)],
                             coordinator_args=coordinator_args),
        }
        try:
            for deployment in deployments.values():
                deployment.start()
            rows.append(measure_length(deployments, prompts, length, args))
        finally:
            for deployment in deployments.values():
                deployment.stop()
        print(json.dumps(rows[-1]), flush=True)
    first = rows[0]["tokens_per_s_on"]
    for row in rows:
        row["throughput_on_vs_shortest"] = row["tokens_per_s_on"] / first
        row["throughput_off_vs_shortest"] = row["tokens_per_s_off"] / rows[0]["tokens_per_s_off"]
    return {"rows": rows, "requests": args.requests, "n": args.n, "question_tokens": args.question_tokens,
            "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "model": args.model or "synthetic",
            "shape": None if args.model else asdict(_shape(args)), "host": host_info()}


def _shape(args: argparse.Namespace) -> LlamaShape:
    return LlamaShape(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                      intermediate=args.intermediate, max_positions=max(16384, 2 * max(args.system_tokens)))


def plot_results(result: dict[str, object], path: str) -> None:
    """Write a PNG: tokens/s vs system-prompt length with the cache on and off, and TTFT of a miss and a hit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    lengths = [row["system_tokens"] for row in rows]
    fig, (ax, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, style in (("on", "o-"), ("off", "s--")):
        ax.plot(lengths, [row[f"tokens_per_s_{mode}"] for row in rows], style, label=f"prefix cache {mode}")
    ax_ttft.plot(lengths, [row["ttft_miss_s_on"] * 1e3 for row in rows], "s--", label="miss")
    ax_ttft.plot(lengths, [row["ttft_hit_s_on"] * 1e3 for row in rows], "o-", label="hit")
    for a in (ax, ax_ttft):
        a.set_xscale("log", base=2)
        a.set_xlabel("shared system prompt (tokens)")
        a.grid(True, which="both", alpha=0.3)
        a.legend()
    ax.set_ylim(bottom=0)
    ax.set_ylabel("generated tokens/s (wall clock, prefills included)")
    ax.set_title(f"{result['requests']} requests x n={result['n']}, {result['max_new_tokens']} new tokens each")
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("time to first token, median (ms)")
    ax_ttft.set_title(f"one request, n={result['n']}, cache on")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print a markdown table (and JSON with ``--json``)."""
    with tempfile.TemporaryDirectory(prefix="specserve-prefix-") as scratch:
        model = Path(args.model) if args.model else save_synthetic_llama(Path(scratch) / "model", _shape(args))
        result = run_prefix_bench(args, model)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot_results(result, args.plot)
    print("| system tokens | TTFT miss (ms) | TTFT hit (ms) | hit speed-up | tok/s cache off | tok/s cache on "
          "| on/off | on vs shortest | off vs shortest |\n|---|---|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        print(f"| {row['system_tokens']} | {row['ttft_miss_s_on'] * 1e3:.0f} | {row['ttft_hit_s_on'] * 1e3:.0f} "
              f"| {row['hit_ttft_speedup']:.1f}x | {row['tokens_per_s_off']:.1f} | {row['tokens_per_s_on']:.1f} "
              f"| {row['throughput_on_over_off']:.2f}x | {row['throughput_on_vs_shortest']:.2f} "
              f"| {row['throughput_off_vs_shortest']:.2f} |")
    return 0
