"""Greedy completions through the three gRPC services are token-for-token HF generate() on the target."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import coordinator_stub
from hf_oracle import greedy
from tiny_models import EOS_ID, FIXED_K

from specserve.v1 import coordinator_pb2

MAX_NEW = 64


def prompts(vocab: int = 300) -> list[list[int]]:
    """Prompts of different lengths (1 to 40 tokens), fixed by a seed."""
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(length)] for length in (1, 5, 12, 40)]


def eos_prompt(path, vocab: int = 300) -> list[int]:
    """A prompt whose HF greedy continuation ends with EOS within MAX_NEW tokens (searched with a seed)."""
    rng = random.Random(11)
    for _ in range(400):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 20))]
        if greedy(path, prompt, MAX_NEW, EOS_ID)[-1:] == [EOS_ID]:
            return prompt
    pytest.fail("no prompt with an EOS in its greedy continuation: the EOS case would go untested")


CASES = [
    pytest.param("llama", "llama", FIXED_K, id="llama-draft-agrees"),
    pytest.param("llama", "llama_draft", FIXED_K, id="llama-random-draft"),
    # the draft's defaults: proposals cut short by the confidence floor, ragged verify windows
    pytest.param("llama", "llama_draft", (), id="llama-random-draft-per-sequence-lengths"),
    pytest.param("qwen2", "qwen2_draft", FIXED_K, id="qwen2-mqa-random-draft"),
    pytest.param("llama", "llama_subset", FIXED_K, id="llama-subset-vocabulary-draft"),
    pytest.param("llama", None, FIXED_K, id="llama-no-draft"),
]


@pytest.mark.parametrize(("target", "draft", "draft_args"), CASES)
def test_concurrent_mixed_batch_matches_hf(deployments, checkpoints, target, draft, draft_args):
    # the gate off: every round with a draft is the draft's, so its acceptance below is measured on all of them
    # (with the gate, how many rounds the draft gets depends on the measured speeds)
    deployment = deployments(target, draft, "--speculation-gate", "off", draft_args=draft_args)
    stub = coordinator_stub(deployment.coordinator_address)
    jobs = []
    for i, prompt in enumerate(prompts()):
        jobs.append((prompt, (1, 3, 8)[i % 3], MAX_NEW - 7 * i, True))
    jobs.append((eos_prompt(checkpoints[target]), 3, MAX_NEW, False))

    def run(job):
        prompt, n, max_new, ignore_eos = job
        request = coordinator_pb2.GenerateRequest(prompt_token_ids=prompt, n=n, max_new_tokens=max_new,
                                                  ignore_eos=ignore_eos)
        return stub.Generate(request, timeout=300)

    with ThreadPoolExecutor(len(jobs)) as pool:
        responses = list(pool.map(run, jobs))
    for (prompt, n, max_new, ignore_eos), response in zip(jobs, responses, strict=True):
        expected = greedy(checkpoints[target], prompt, max_new, None if ignore_eos else EOS_ID)
        assert len(response.completions) == n
        for completion in response.completions:
            assert list(completion.token_ids) == expected
            want = "length" if ignore_eos or expected[-1] != EOS_ID else "eos"
            assert completion.finish_reason == want
        usage = response.usage
        assert usage.prompt_tokens == len(prompt)
        assert usage.completion_tokens == n * len(expected)
        assert usage.rounds >= 1
        assert 0 <= usage.draft_tokens_accepted <= usage.draft_tokens_proposed
        if draft is None:
            assert usage.draft_tokens_proposed == 0
    total = sum(r.usage.draft_tokens_proposed for r in responses)
    accepted = sum(r.usage.draft_tokens_accepted for r in responses)
    if draft == target:  # the draft is the target itself: almost everything is accepted
        assert accepted >= 0.9 * total
    if draft == "llama_subset":  # the target itself on its first 288 ids (measured: 303 of 887 accepted)
        assert accepted >= 0.2 * total


def test_stream_equals_unary(deployments):
    deployment = deployments("llama", "llama_draft")
    stub = coordinator_stub(deployment.coordinator_address)
    request = coordinator_pb2.GenerateRequest(prompt="def area(radius):", n=3, max_new_tokens=24, ignore_eos=True)
    unary = stub.Generate(request, timeout=120)
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    texts: dict[int, str] = {0: "", 1: "", 2: ""}
    reasons: dict[int, str] = {}
    chunks = list(stub.GenerateStream(request, timeout=120))
    for chunk in chunks[:-1]:
        tokens[chunk.index] += chunk.token_ids
        texts[chunk.index] += chunk.text
        if chunk.finish_reason:
            reasons[chunk.index] = chunk.finish_reason
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens
    assert len(chunks) > 4  # tokens arrive round by round, not at the end
    for completion in unary.completions:
        assert tokens[completion.index] == list(completion.token_ids)
        assert texts[completion.index] == completion.text
        assert reasons[completion.index] == completion.finish_reason == "length"


def test_stop_string_truncates(deployments):
    deployment = deployments("llama", "llama_draft")
    stub = coordinator_stub(deployment.coordinator_address)
    base = coordinator_pb2.GenerateRequest(prompt="import os\n", max_new_tokens=40, ignore_eos=True)
    full = stub.Generate(base, timeout=120).completions[0]
    stop = full.text[10:13]
    assert stop, "the greedy text is too short to cut"
    request = coordinator_pb2.GenerateRequest(prompt="import os\n", max_new_tokens=40, ignore_eos=True, stop=[stop])
    cut = stub.Generate(request, timeout=120).completions[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert list(cut.token_ids) == list(full.token_ids[: len(cut.token_ids)])
    assert len(cut.token_ids) < len(full.token_ids)


def test_plain_rounds_between_speculative_ones(deployments, checkpoints):
    """With the gate on and probes from every 2nd round (backing off while they confirm speculation), plain
    decode rounds (no draft call; the coordinator's lookup off) run between speculative ones: the draft
    catches up on the plain rounds' tokens, so a draft that is the target itself still has nearly everything
    it proposes accepted, and the output is still HF's. (With lookup rounds: tests/test_coordinator_lookup.py.)"""
    deployment = deployments("llama", "llama", "--speculation-gate", "--speculation-probe-every", "2",
                             "--prompt-lookup", "off")
    stub = coordinator_stub(deployment.coordinator_address)
    jobs = [(prompt, (1, 3)[i % 2]) for i, prompt in enumerate(prompts())]

    def run(job):
        prompt, n = job
        request = coordinator_pb2.GenerateRequest(prompt_token_ids=prompt, n=n, max_new_tokens=MAX_NEW,
                                                  ignore_eos=True)
        return stub.Generate(request, timeout=300)

    with ThreadPoolExecutor(len(jobs)) as pool:
        responses = list(pool.map(run, jobs))
    for (prompt, _), response in zip(jobs, responses, strict=True):
        expected = greedy(checkpoints["llama"], prompt, MAX_NEW, None)
        assert all(list(c.token_ids) == expected for c in response.completions)
        usage = response.usage
        assert usage.draft_tokens_accepted >= 0.9 * usage.draft_tokens_proposed > 0
        assert usage.rounds > usage.plain_rounds and usage.lookup_rounds == 0
    # the batch's second round is plain (the gate measures both kinds early), and so are its probes; how many
    # fall within each request depends on when it joined and on the measured speeds
    assert sum(r.usage.plain_rounds for r in responses) >= 1


def test_each_batch_starts_at_the_initial_draft_length(deployments):
    """The draft length grown in one batch does not carry into the next: with a draft that is the target
    itself, k grows 4, 5, ... in every request's batch, so two requests run one after another (a fresh
    batch each) take the same rounds (k carried over at its maximum would need fewer). The gate is off: its
    choices depend on measured speeds, which would make the rounds differ."""
    stub = coordinator_stub(deployments("llama", "llama", "--speculation-gate", "off").coordinator_address)
    request = coordinator_pb2.GenerateRequest(prompt_token_ids=prompts()[2], n=2, max_new_tokens=MAX_NEW,
                                              ignore_eos=True)
    first, second = (stub.Generate(request, timeout=300) for _ in range(2))
    assert first.usage.draft_tokens_accepted == first.usage.draft_tokens_proposed > 0
    assert [list(c.token_ids) for c in first.completions] == [list(c.token_ids) for c in second.completions]
    assert second.usage.rounds == first.usage.rounds


def test_a_lookup_round_that_finds_nothing_counts_against_lookup(deployments, checkpoints):
    """With a draft and the coordinator's lookup, a greedy batch chooses between draft and lookup rounds; a
    lookup round that finds nothing is a plain step, and the gate charges it to lookup. Here lookup never finds
    anything (its n-grams are 40 tokens long) and the draft is the target itself, so a draft round's k draft
    steps cost about what its k extra tokens save and either kind may measure faster on a loaded machine. What
    must hold is that both were measured and the other kind is probed again: were the empty lookup rounds not
    counted, lookup would stay unmeasured and run every round after the draft's first (1 draft round of 48)."""
    stub = coordinator_stub(deployments("llama", "llama", "--prompt-lookup", "40,40").coordinator_address)
    prompt = prompts()[2]
    request = coordinator_pb2.GenerateRequest(prompt_token_ids=prompt, n=2, max_new_tokens=MAX_NEW, ignore_eos=True)
    response = stub.Generate(request, timeout=300)
    assert all(list(c.token_ids) == greedy(checkpoints["llama"], prompt, MAX_NEW, None) for c in response.completions)
    usage = response.usage
    assert usage.lookup_rounds == usage.lookup_tokens_proposed == 0  # the premise: lookup found nothing
    draft_rounds = usage.rounds - usage.plain_rounds
    assert usage.plain_rounds >= 1 and draft_rounds >= 2  # the first of each, and probes of the slower one
    assert usage.draft_tokens_accepted == usage.draft_tokens_proposed > 0
