"""Completion logprobs: each token's log-probability under the target's own distribution, checked against an
HF forward pass over the prompt and the completion, through the three gRPC services."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import coordinator_stub
from hf_oracle import load

from coordinator.completion import SampleOutput
from coordinator.text import TextCodec
from specserve.v1 import coordinator_pb2

PROMPT = [5, 17, 42, 99, 7, 23, 5, 17]


def hf_logprobs(path, prompt: list[int], completion: list[int]) -> list[float]:
    """log_softmax of the HF model's logits (no temperature, no filtering) at each completion token."""
    with torch.inference_mode():
        logits = load(path)(torch.tensor([prompt + completion])).logits[0].float()
    scores = logits[len(prompt) - 1:-1].log_softmax(dim=-1)
    return scores.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist()


def request(**fields) -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=24, ignore_eos=True, **fields)


@pytest.mark.parametrize("sampling", [
    pytest.param({"n": 2}, id="greedy"),
    pytest.param({"n": 3, "temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 3}, id="sampled-filtered"),
])
def test_logprobs_are_the_target_models_own(deployments, checkpoints, sampling):
    """Every token of every sample, first token and speculatively accepted ones alike, carries the target's
    unprocessed log-probability (not the tempered or filtered one), and the cumulative one is their sum."""
    # the draft is the target itself and the gate is off: most rounds accept several draft tokens, so window
    # positions past the first are scored too
    deployment = deployments("llama", "llama", "--speculation-gate", "off")
    response = coordinator_stub(deployment.coordinator_address).Generate(request(logprobs=True, **sampling),
                                                                          timeout=300)
    assert response.usage.draft_tokens_accepted > 0
    for completion in response.completions:
        tokens = list(completion.token_ids)
        assert len(completion.token_logprobs) == len(tokens) == 24
        expected = hf_logprobs(checkpoints["llama"], PROMPT, tokens)
        assert list(completion.token_logprobs) == pytest.approx(expected, abs=2e-4)
        assert completion.cumulative_logprob == pytest.approx(sum(completion.token_logprobs), abs=1e-6)
        assert all(value <= 0 for value in completion.token_logprobs)


def test_logprobs_only_when_asked_and_streamed_alike(deployments):
    """A request without logprobs gets none; a streamed request gets each chunk's tokens' logprobs, together
    the same as the unary response's for the same seed."""
    deployment = deployments("llama", "llama_draft", "--speculation-gate", "off")
    stub = coordinator_stub(deployment.coordinator_address)
    sampled = {"n": 2, "temperature": 0.9, "seed": 11}
    plain = stub.Generate(request(**sampled), timeout=300)
    assert all(not c.token_logprobs and c.cumulative_logprob == 0 for c in plain.completions)
    unary = stub.Generate(request(logprobs=True, **sampled), timeout=300)
    assert [list(c.token_ids) for c in unary.completions] == [list(c.token_ids) for c in plain.completions]
    streamed: dict[int, tuple[list[int], list[float]]] = {}
    for chunk in stub.GenerateStream(request(logprobs=True, **sampled), timeout=300):
        if chunk.HasField("usage"):
            continue
        assert len(chunk.token_logprobs) == len(chunk.token_ids)
        tokens, logprobs = streamed.setdefault(chunk.index, ([], []))
        tokens += chunk.token_ids
        logprobs += chunk.token_logprobs
    for completion in unary.completions:
        assert streamed[completion.index] == (list(completion.token_ids), list(completion.token_logprobs))


def test_a_sample_keeps_one_logprob_per_token_where_a_stopping_rule_cuts() -> None:
    """Tokens past a stopping rule are dropped with their logprobs; a count that does not match is an error."""
    sample = SampleOutput(index=0, sequence_id=1, max_new_tokens=4, eos_token_ids=frozenset({2}), stop=[],
                          codec=TextCodec(""))
    delta = sample.extend([7, 8], [-0.5, -1.0])
    assert delta.logprobs == [-0.5, -1.0]
    delta = sample.extend([9, 2, 11], [-0.25, -2.0, -3.0])  # EOS at the second token
    assert sample.token_ids == [7, 8, 9, 2] and sample.logprobs == [-0.5, -1.0, -0.25, -2.0]
    assert delta.logprobs == [-0.25, -2.0] and sample.finish_reason == "eos"
    assert math.isclose(sum(sample.logprobs), -3.75)
    with pytest.raises(ValueError, match="2 logprobs for 1 tokens"):
        SampleOutput(index=0, sequence_id=2, max_new_tokens=4, eos_token_ids=frozenset(), stop=[],
                     codec=TextCodec("")).extend([3], [-1.0, -2.0])


def test_generate_cli_asks_for_logprobs_and_prints_their_sum_and_mean(capsys: pytest.CaptureFixture) -> None:
    """``specserve generate --logprobs`` sets the request field and prints each sample's score."""
    from cli_parsing import parse_cli

    from specserve.generate import print_response, request_from_args

    args = parse_cli(["generate", "--prompt", "def f():", "-n", "2", "--logprobs"], "this test")
    assert request_from_args(args).logprobs
    assert not request_from_args(parse_cli(["generate", "--prompt", "x"], "this test")).logprobs
    response = coordinator_pb2.GenerateResponse(completions=[
        coordinator_pb2.Completion(index=0, token_ids=[4, 5], text=" pass", finish_reason="length",
                                   token_logprobs=[-0.5, -1.5], cumulative_logprob=-2.0),
        coordinator_pb2.Completion(index=1, token_ids=[6], text=" ...", finish_reason="eos")])
    print_response(response, "def f():")
    out = capsys.readouterr().out
    assert "--- sample 0 (length, 2 tokens, logprob -2.000 (mean -1.000))" in out
    assert "--- sample 1 (eos, 1 tokens)\n" in out
