"""What a target verify costs against the tokens in it: the curve that decides whether a proposal pays.

One group of ``--rows`` sequences on the target (default: the default pair's), prefilled once with a held-out
code prompt; then, for each extra-token count T in ``--extra``, a verify of the batch in which T proposed
tokens (spread round-robin over the rows, each row's window its pending token plus its share) ride along
with the rows' own tokens. T = 0 is a plain decode step. The calls are timed interleaved; each figure is the
median of ``--repeats``, also as a ratio to the plain step. ``--linears packed,stock`` times the engine's
float32 CPU linear layers on packed weights (``engine.cpu_linear``, what serving runs) against transformers'
``nn.Linear`` (BLAS ``sgemm``), interleaved in one process; with ``sgemm`` on a CPU the cost follows the
GEMM's blocks of rows rather than the token count (the first tokens beyond a block cost nearly a block;
docs/benchmarks.md). ``--served`` also starts a target service on loopback (``specserve serve target``, the same
model and dtype, its default packed linear layers) and times the same verifies as ``Verify`` RPCs, interleaved
with the in-process calls: what serving adds to a step (transport, the server's threads), the figure the
< 10 % gRPC-overhead goal is judged on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.arguments import comma_items, non_negative_int_list
from bench.prompts import code_prompts
from bench.timing import host_info, time_interleaved
from deployment.processes import ServerProcess, free_port
from engine.batch import GroupInput
from engine.checkpoint import load_checkpoint
from engine.default_models import DefaultModelError, default_model
from engine.sampling import SamplingParams, point_distribution
from engine.target import TargetRuntime
from serving.model_service import distribution_to_proto, sampling_to_proto

BATCH_ID = "bench-verify"
LINEAR_MODES = ("packed", "stock")
SERVED = "served"  # the system of ``--served``: the target service's Verify RPC
RPC_TIMEOUT_S = 600.0


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
    parser.add_argument("--served", action="store_true",
                        help="also time each verify as a Verify RPC to a target service started on loopback (same "
                             "model and dtype, packed linears), interleaved with the in-process calls")
    parser.add_argument("--json", help="write the results as JSON to this path")


def shares(extra: int, rows: int) -> list[int]:
    """``extra`` proposed tokens spread round-robin over ``rows`` rows (the first rows get one more)."""
    return [extra // rows + (row < extra % rows) for row in range(rows)]


def _plan(rows: int, extras: list[int], repeats: int) -> tuple[list[int], int]:
    """The rows' sequence ids, and the max_new_tokens that leaves room for ``repeats`` + 1 calls of every count of
    ``extras`` (each call appends to the rows' caches: the context grows by a few tokens per call, a negligible
    drift, the same for every count)."""
    per_call = max(max(extras) // rows + 2, 2)
    return list(range(rows)), per_call * (repeats + 1) * len(extras)


def verify_calls(runtime: TargetRuntime, batch_id: str, prompt: list[int], rows: int, extras: list[int],
                 params: SamplingParams, repeats: int) -> dict[int, Callable[[], object]]:
    """Prefill a batch ``batch_id`` of ``rows`` sequences of ``prompt`` with room for ``repeats`` + 1 calls per
    count, and return for each count of ``extras`` a call that verifies the batch with that many proposed
    tokens (copies of the prompt's last token) and returns the runtime's verdicts (the caller releases the
    batch)."""
    ids, budget = _plan(rows, extras, repeats)
    runtime.prefill(batch_id, [GroupInput(0, prompt, ids, params, max_new_tokens=budget)])
    token = prompt[-1]

    def call(extra: int) -> object:
        proposals = {}
        for sequence, count in zip(ids, shares(extra, rows), strict=True):
            proposals[sequence] = ([token] * count, [] if params.greedy else [point_distribution(token)] * count)
        return runtime.verify(batch_id, proposals)

    return {extra: (lambda extra=extra: call(extra)) for extra in extras}


def served_verify_calls(stub: Any, batch_id: str, prompt: list[int], rows: int, extras: list[int],
                        params: SamplingParams, repeats: int) -> dict[int, Callable[[], object]]:
    """``verify_calls`` over gRPC: prefill the same batch on the target service behind ``stub`` (a
    ``TargetModelStub``) and return, per count, a call that sends the same proposals as one ``Verify`` RPC,
    building its request as the coordinator does, and returns the ``VerifyResponse`` (the caller releases the
    batch)."""
    from specserve.v1 import model_pb2

    ids, budget = _plan(rows, extras, repeats)
    group = model_pb2.GroupSpec(group_id=0, prompt_token_ids=prompt, sequence_ids=ids,
                                sampling=sampling_to_proto(params), max_new_tokens=budget)
    stub.Prefill(model_pb2.PrefillRequest(batch_id=batch_id, groups=[group]), timeout=RPC_TIMEOUT_S)
    token = prompt[-1]

    def call(extra: int) -> object:
        point = [] if params.greedy else [distribution_to_proto(point_distribution(token))]
        proposals = [model_pb2.Proposal(sequence_id=sequence, token_ids=[token] * count, distributions=point * count)
                     for sequence, count in zip(ids, shares(extra, rows), strict=True)]
        return stub.Verify(model_pb2.VerifyRequest(batch_id=batch_id, proposals=proposals), timeout=RPC_TIMEOUT_S)

    return {extra: (lambda extra=extra: call(extra)) for extra in extras}


def verify_costs(runtimes: dict[str, TargetRuntime], prompt: list[int], rows: int, extras: list[int],
                 params: SamplingParams, repeats: int, served: Any = None) -> dict[tuple[str, int], float]:
    """Median seconds of one verify of ``rows`` sequences carrying each count of ``extras`` proposed tokens, on
    each runtime (keyed by its name) and, given ``served`` (a ``TargetModelStub``), on that service (keyed
    ``SERVED``), every call of every system interleaved with the others."""
    calls: dict[tuple[str, int], Callable[[], object]] = {}
    try:
        for name, runtime in runtimes.items():
            for extra, call in verify_calls(runtime, BATCH_ID, prompt, rows, extras, params, repeats).items():
                calls[name, extra] = call
        if served is not None:
            for extra, call in served_verify_calls(served, BATCH_ID, prompt, rows, extras, params, repeats).items():
                calls[SERVED, extra] = call
        return time_interleaved(calls, repeats)
    finally:
        for runtime in runtimes.values():
            runtime.release(BATCH_ID)  # a no-op for a runtime whose prefill did not run


def start_target_service(model: str, dtype: str) -> tuple[ServerProcess, Any]:
    """A ``specserve serve target`` process for ``model`` on a free loopback port, serving (no prefix cache:
    the verifies measure a step, as the in-process runtime's do), and a ``TargetModelStub`` to it; the caller
    stops the process."""
    import grpc

    from serving.grpc_server import CHANNEL_OPTIONS
    from specserve.v1 import model_pb2_grpc

    server = ServerProcess("target", free_port(), ["--model", model, "--dtype", dtype, "--prefix-cache-mb", "0"])
    server.start()
    try:
        server.wait_serving()
    except BaseException:
        server.stop()
        raise
    channel = grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS)
    return server, model_pb2_grpc.TargetModelStub(channel)


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
    spin = os.environ.get("GOMP_SPINCOUNT")
    if args.served and spin is None:
        print("specserve bench verify: GOMP_SPINCOUNT is not set, so this process's OpenMP threads spin for "
              "milliseconds after each in-process call and slow the service's next one; set it (e.g. 20000, as "
              "the services get) for a fair comparison", file=sys.stderr)
    service, stub = start_target_service(model, args.dtype) if args.served else (None, None)
    try:
        costs = verify_costs(runtimes, prompt, args.rows, extras, params, args.repeats, stub)
    finally:
        if service is not None:
            service.stop()
    systems = [*args.linears, *([SERVED] if args.served else [])]
    result = {"host": host_info(), "model": model, "dtype": args.dtype, "rows": args.rows,
              "temperature": args.temperature, "top_p": args.top_p,
              "top_k": args.top_k, "repeats": args.repeats, "prompt_tokens": len(prompt), "gomp_spincount": spin,
              "points": [{"system": name, "extra_tokens": e, "tokens": args.rows + e, "ms": 1000 * costs[name, e],
                          "vs_plain": costs[name, e] / costs[name, 0]} for name in systems for e in extras]}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"{args.rows} rows, {len(prompt)}-token prompt, {args.dtype}, T = {args.temperature:g}, top-p "
          f"{args.top_p:g}, top-k {args.top_k}, medians of {args.repeats}\n")
    print(_table(costs, systems, extras, args.rows))
    return 0


def _table(costs: dict[tuple[str, int], float], systems: list[str], extras: list[int], rows: int) -> str:
    """Markdown: per count, each system's milliseconds and ratio to its plain step, and every other system's time
    over the first's."""
    head = ["proposed tokens", "tokens in the verify"] + [f"{m}: {c}" for m in systems for c in ("ms", "vs plain")]
    head += [f"{m} / {systems[0]}" for m in systems[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for e in extras:
        cells = [str(e), str(rows + e)]
        for m in systems:
            cells += [f"{1000 * costs[m, e]:.1f}", f"{costs[m, e] / costs[m, 0]:.2f}"]
        cells += [f"{costs[m, e] / costs[systems[0], e]:.2f}" for m in systems[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
