"""What a target verify costs against the tokens in it: the curve that decides whether a proposal pays.

One group of ``--rows`` sequences on the target (default: the default pair's), prefilled once with a held-out
code prompt; then, for each extra-token count T in ``--extra``, a verify of the batch in which T proposed
tokens (spread round-robin over the rows, each row's window its pending token plus its share) ride along
with the rows' own tokens. T = 0 is a plain decode step. The calls are timed interleaved; each figure is the
median of ``--repeats``, also as a ratio to the plain step. ``--linears packed,stock`` times the engine's
float32 CPU linear layers on packed weights (``engine.cpu_linear``, what serving runs) against transformers'
``nn.Linear`` (BLAS ``sgemm``), interleaved in one process; with ``sgemm`` on a CPU the cost follows the
GEMM's blocks of rows rather than the token count (the first tokens beyond a block cost nearly a block;
docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from bench.arguments import comma_items, non_negative_int_list
from bench.prompts import code_prompts
from bench.timing import host_info, time_interleaved
from engine.batch import GroupInput
from engine.checkpoint import load_checkpoint
from engine.default_models import DefaultModelError, default_model
from engine.sampling import SamplingParams, point_distribution
from engine.target import TargetRuntime

BATCH_ID = "bench-verify"
LINEAR_MODES = ("packed", "stock")


def linear_modes(text: str) -> list[str]:
    """The distinct modes of a comma-separated ``--linears`` value, in order; raises ArgumentTypeError for an
    unknown or missing one."""
    modes = list(dict.fromkeys(comma_items(text)))
    if not modes or set(modes) - set(LINEAR_MODES):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(LINEAR_MODES)}, got {text!r}")
    return modes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``specserve bench verify``."""
    parser.add_argument("--target-model", default=None,
                        help="local HF checkpoint (default: the default pair's target, SmolLM2-135M-Instruct)")
    parser.add_argument("--rows", type=int, default=8, help="sequences in the batch (one group)")
    parser.add_argument("--extra", type=non_negative_int_list, default=[0, 1, 2, 4, 8, 9, 12, 16, 24, 32],
                        help="comma-separated counts of proposed tokens per verify, over all rows (0: plain step)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy acceptance; > 0: rejection sampling against point distributions")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus filter of the sampled rows (1: off)")
    parser.add_argument("--top-k", type=int, default=0, help="top-k filter of the sampled rows (0: off)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dtype", default="float32", help="the target's dtype (float32, bfloat16)")
    parser.add_argument("--linears", type=linear_modes, default=["packed"],
                        help="comma-separated: packed (the engine's float32 CPU linear layers on oneDNN-packed "
                             "weights, what serving runs), stock (transformers' nn.Linear); both: timed interleaved")
    parser.add_argument("--json", help="write the results as JSON to this path")


def shares(extra: int, rows: int) -> list[int]:
    """``extra`` proposed tokens spread round-robin over ``rows`` rows (the first rows get one more)."""
    return [extra // rows + (row < extra % rows) for row in range(rows)]


def verify_calls(runtime: TargetRuntime, batch_id: str, prompt: list[int], rows: int, extras: list[int],
                 params: SamplingParams, repeats: int) -> dict[int, Callable[[], object]]:
    """Prefill a batch ``batch_id`` of ``rows`` sequences of ``prompt`` with room for ``repeats`` + 1 calls per
    count, and return for each count of ``extras`` a call that verifies the batch with that many proposed
    tokens (the caller releases the batch). Each call appends to the rows' caches, so the context grows by a
    few tokens per call (a negligible drift, the same for every count)."""
    ids = list(range(rows))
    per_call = max(max(extras) // rows + 2, 2)
    budget = per_call * (repeats + 1) * len(extras)
    runtime.prefill(batch_id, [GroupInput(0, prompt, ids, params, max_new_tokens=budget)])
    token = prompt[-1]

    def call(extra: int) -> None:
        proposals = {}
        for sequence, count in zip(ids, shares(extra, rows), strict=True):
            proposals[sequence] = ([token] * count, [] if params.greedy else [point_distribution(token)] * count)
        runtime.verify(batch_id, proposals)

    return {extra: (lambda extra=extra: call(extra)) for extra in extras}


def verify_costs(runtimes: dict[str, TargetRuntime], prompt: list[int], rows: int, extras: list[int],
                 params: SamplingParams, repeats: int) -> dict[tuple[str, int], float]:
    """Median seconds of one verify of ``rows`` sequences carrying each count of ``extras`` proposed tokens, on
    each runtime (keyed by its name), every call of every runtime interleaved with the others."""
    calls: dict[tuple[str, int], Callable[[], object]] = {}
    try:
        for name, runtime in runtimes.items():
            for extra, call in verify_calls(runtime, BATCH_ID, prompt, rows, extras, params, repeats).items():
                calls[name, extra] = call
        return time_interleaved(calls, repeats)
    finally:
        for runtime in runtimes.values():
            runtime.release(BATCH_ID)  # a no-op for a runtime whose prefill did not run


def run(args: argparse.Namespace) -> int:
    """Time the verifies and print a markdown table (and JSON with ``--json``)."""
    if args.rows < 1 or args.repeats < 1:
        raise SystemExit("specserve bench verify: --rows and --repeats must be >= 1")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=0)
    try:
        params.validate()
    except ValueError as error:
        raise SystemExit(f"specserve bench verify: {error}") from error
    try:
        model = args.target_model or str(default_model("target"))
    except DefaultModelError as error:
        raise SystemExit(str(error)) from error
    checkpoints = {name: load_checkpoint(model, dtype=args.dtype, packed_linears=name == "packed")
                   for name in args.linears}
    runtimes = {name: TargetRuntime(checkpoint) for name, checkpoint in checkpoints.items()}
    prompt = code_prompts(checkpoints[args.linears[0]].tokenizer, 1)[0].token_ids
    extras = sorted(set(args.extra) | {0})
    costs = verify_costs(runtimes, prompt, args.rows, extras, params, args.repeats)
    result = {"host": host_info(), "model": model, "dtype": args.dtype, "rows": args.rows,
              "temperature": args.temperature, "top_p": args.top_p,
              "top_k": args.top_k, "repeats": args.repeats, "prompt_tokens": len(prompt),
              "points": [{"linears": name, "extra_tokens": e, "tokens": args.rows + e, "ms": 1000 * costs[name, e],
                          "vs_plain": costs[name, e] / costs[name, 0]} for name in args.linears for e in extras]}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"{args.rows} rows, {len(prompt)}-token prompt, {args.dtype}, T = {args.temperature:g}, top-p "
          f"{args.top_p:g}, top-k {args.top_k}, medians of {args.repeats}\n")
    print(_table(costs, args.linears, extras, args.rows))
    return 0


def _table(costs: dict[tuple[str, int], float], modes: list[str], extras: list[int], rows: int) -> str:
    """Markdown: per count, each mode's milliseconds and ratio to its plain step (and with two modes, the
    second's time over the first's)."""
    compare = len(modes) == 2
    head = ["proposed tokens", "tokens in the verify"] + [f"{m}: {c}" for m in modes for c in ("ms", "vs plain")]
    head += [f"{modes[1]} / {modes[0]}"] if compare else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for e in extras:
        cells = [str(e), str(rows + e)]
        for m in modes:
            cells += [f"{1000 * costs[m, e]:.1f}", f"{costs[m, e] / costs[m, 0]:.2f}"]
        cells += [f"{costs[modes[1], e] / costs[modes[0], e]:.2f}"] if compare else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
