"""Ask a coordinator for n completions of a prompt and print them."""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from serving import telemetry
from serving.grpc_server import open_channel
from serving.tls import TLSFiles
from specserve.v1 import coordinator_pb2, coordinator_pb2_grpc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``specserve generate``."""
    parser.add_argument("--coordinator", default="127.0.0.1:50050", help="HOST:PORT of the coordinator")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("-n", type=int, default=1, help="samples sharing the prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--logprobs", action="store_true",
                        help="return each token's log-probability under the target; samples print their sum and mean")
    parser.add_argument("--timeout", type=float, default=600.0, help="request deadline (s)")
    parser.add_argument("--json", action="store_true", help="print the response as JSON")
    parser.add_argument("--tls-ca")
    parser.add_argument("--tls-cert")
    parser.add_argument("--tls-key")


def request_from_args(args: argparse.Namespace) -> coordinator_pb2.GenerateRequest:
    """The GenerateRequest the flags describe."""
    return coordinator_pb2.GenerateRequest(
        prompt=args.prompt, n=args.n, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
        logprobs=args.logprobs)


def print_response(response: coordinator_pb2.GenerateResponse, prompt: str) -> None:
    """Human-readable completions and usage."""
    for completion in response.completions:
        total, count = completion.cumulative_logprob, len(completion.token_logprobs)
        score = f", logprob {total:.3f} (mean {total / count:.3f})" if count else ""
        print(f"--- sample {completion.index} ({completion.finish_reason}, {len(completion.token_ids)} tokens{score})")
        print(prompt + completion.text)
    usage = response.usage
    rate = usage.draft_tokens_accepted / usage.draft_tokens_proposed if usage.draft_tokens_proposed else 0.0
    print(f"--- usage: prompt {usage.prompt_tokens}, completion {usage.completion_tokens} tokens, "
          f"{usage.rounds} rounds ({usage.lookup_rounds} lookup, {usage.plain_rounds} plain), draft acceptance "
          f"{rate:.2f} ({usage.draft_tokens_accepted}/{usage.draft_tokens_proposed}), lookup "
          f"{usage.lookup_tokens_accepted}/{usage.lookup_tokens_proposed}, "
          f"{usage.draft_proposal_bytes / max(usage.rounds, 1):.0f} proposal bytes/round")


def run(args: argparse.Namespace) -> int:
    """Send one request; exit status 1 with the gRPC status on failure."""
    channel = open_channel(args.coordinator, TLSFiles(args.tls_cert, args.tls_key, args.tls_ca))
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    telemetry.setup_tracing("client")  # with OTEL_EXPORTER_OTLP_ENDPOINT set, the request joins a client trace
    span = telemetry.start_span("client.generate", kind=telemetry.SpanKind.CLIENT, attributes={"specserve.n": args.n})
    try:
        response = stub.Generate(request_from_args(args), timeout=args.timeout,
                                 metadata=telemetry.inject_metadata(span))
    except grpc.RpcError as error:
        print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    finally:
        span.end()
        telemetry.shutdown_tracing()
    if args.json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps(MessageToDict(response), indent=2))
    else:
        print_response(response, args.prompt)
    return 0
