"""The serving path on a CUDA GPU: the runtime with the Triton kernels and CUDA graphs, bf16, and
``specserve serve target --device cuda`` end to end. Skipped where torch sees no CUDA device."""

from __future__ import annotations

import pytest
import torch
from conftest import coordinator_stub
from engine_cases import PROMPTS, greedy_decode, groups
from hf_oracle import greedy

from engine.checkpoint import load_checkpoint
from engine.draft import DraftRuntime
from engine.target import TargetRuntime
from specserve.v1 import coordinator_pb2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def speculative_rounds(runtime: TargetRuntime, reference: dict[int, list[int]], rounds: int) -> list[list[int]]:
    """Verify rounds whose proposals are the next tokens of ``reference`` (all accepted) for even sequence ids
    and a wrong token for odd ones; returns each round's (accepted_len, next token) pairs."""
    runtime.prefill("s", groups())
    done = {sid: 1 for sid in reference}
    seen = []
    for r in range(rounds):
        proposals = {}
        for sid, count in done.items():
            k = 1 + (r + sid) % 3
            tokens = reference[sid][count:count + k] if sid % 2 == 0 else [0] * k
            proposals[sid] = (tokens, [])
        verdicts = runtime.verify("s", proposals)
        seen.append([(v.accepted_len, v.next_token_id) for v in verdicts])
        for v in verdicts:
            done[v.sequence_id] += v.accepted_len + 1
    return seen


def test_cuda_graphs_replay_what_eager_computes(checkpoints) -> None:
    model = load_checkpoint(checkpoints["llama"], device="cuda")
    graphed = TargetRuntime(model)
    eager = TargetRuntime(model, cuda_graphs=False)
    assert graphed.attention_backend == "triton" and graphed.cuda_graphs and not eager.cuda_graphs
    reference = greedy_decode(eager, 14)
    assert greedy_decode(graphed, 14) == reference
    for g, prompt in PROMPTS.items():
        assert reference[10 * g] == greedy(checkpoints["llama"], prompt, 15, None)
    assert speculative_rounds(graphed, reference, 4) == speculative_rounds(eager, reference, 4)
    assert graphed._graphs.captures >= 2  # the width-1 decode step and at least one verify bucket


def test_draft_propose_loop_through_graphs(checkpoints) -> None:
    model = load_checkpoint(checkpoints["llama_draft"], device="cuda")
    results = []
    for graphs in (True, False):
        runtime = DraftRuntime(model, cuda_graphs=graphs, confidence_floor=0.0)
        runtime.prefill("a", groups())
        for state in runtime.batches["a"].sequences:
            state.pending = [state.sequence_id + 3]
        proposals = []
        for r in range(4):
            updates = {s.sequence_id: (r % 2, 50 + s.sequence_id, ()) for s in runtime.batches["a"].sequences}
            proposals.append([p.token_ids for p in runtime.propose("a", updates, 4)])
        results.append(proposals)
    assert results[0] == results[1]


def test_bfloat16_on_cuda_agrees_with_the_torch_backend(checkpoints) -> None:
    model = load_checkpoint(checkpoints["qwen2"], "bfloat16", "cuda")
    outputs = [greedy_decode(TargetRuntime(model, attention_backend=backend), 6) for backend in ("triton", "torch")]
    for g in PROMPTS:
        assert outputs[0][10 * g][:4] == outputs[1][10 * g][:4]


def test_serve_target_and_draft_on_cuda(deployments, checkpoints) -> None:
    deployment = deployments("llama", "llama_draft", model_args=("--device", "cuda"))
    stub = coordinator_stub(deployment.coordinator_address)
    prompt = PROMPTS[0]
    response = stub.Generate(coordinator_pb2.GenerateRequest(prompt_token_ids=prompt, n=4, max_new_tokens=24,
                                                             ignore_eos=True), timeout=300)
    expected = greedy(checkpoints["llama"], prompt, 24, None)
    assert [list(c.token_ids) for c in response.completions] == [expected] * 4
