"""Sampling through the three services: reproducible by seed, and with a fixed draft length a request's
completions do not depend on the other requests sharing its batch, also where the draft's confidence floor
makes every sequence's proposal length its own."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import coordinator_stub

from specserve.v1 import coordinator_pb2


def sampled(seed: int, prompt: list[int], n: int = 4) -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(prompt_token_ids=prompt, n=n, max_new_tokens=40, temperature=0.9,
                                           top_p=0.95, top_k=50, seed=seed, ignore_eos=True)


def tokens(response: coordinator_pb2.GenerateResponse) -> list[list[int]]:
    return [list(c.token_ids) for c in response.completions]


# The random tiny model's top probabilities are 0.03-0.08: a floor of 0.002 cuts proposals to 1 or 2 of the 3.
@pytest.mark.parametrize("floor", ["0", "0.002"], ids=["every-proposal-k-long", "per-sequence-lengths"])
def test_same_seed_same_completions_alone_or_in_a_crowd(deployments, floor):
    deployment = deployments("llama", "llama", "--fixed-draft-len", "--draft-len", "3",
                             draft_args=("--confidence-floor", floor))
    stub = coordinator_stub(deployment.coordinator_address)
    request = sampled(seed=7, prompt=[11, 12, 13, 14])
    alone = tokens(stub.Generate(request, timeout=120))
    assert tokens(stub.Generate(request, timeout=120)) == alone
    assert len({tuple(t) for t in alone}) > 1, "the samples of one request must differ from each other"
    assert tokens(stub.Generate(sampled(seed=8, prompt=[11, 12, 13, 14]), timeout=120)) != alone
    others = [sampled(seed=100 + i, prompt=[20 + i, 30, 40], n=1 + i % 3) for i in range(5)]
    with ThreadPoolExecutor(6) as pool:
        crowd = list(pool.map(lambda r: stub.Generate(r, timeout=120), [*others[:3], request, *others[3:]]))
    assert tokens(crowd[3]) == alone
    usage = crowd[3].usage
    assert usage.draft_tokens_proposed > 0 and usage.draft_proposal_bytes > 0
