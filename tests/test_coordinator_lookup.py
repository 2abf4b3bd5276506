"""The coordinator's prompt lookup in rounds without a draft call (coordinator.lookup), through real services:
greedy output stays HF generate's, a draft catches up on the tokens those rounds accepted, and sampled
output keeps exactly the target's distribution."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import coordinator_stub
from distribution_oracle import VOCAB, chi_square_pvalue, exact_distribution, tiny
from hf_oracle import greedy
from test_e2e_greedy import MAX_NEW, prompts
from transformers import LlamaForCausalLM

from deployment.processes import Deployment
from engine.sampling import SamplingParams
from specserve.v1 import coordinator_pb2

ALPHA = 1e-3
SAMPLES = 6000


def generate_all(stub, jobs: list[tuple[list[int], int]]) -> list[coordinator_pb2.GenerateResponse]:
    """Greedy requests (prompt, n) sent concurrently, MAX_NEW tokens each."""
    def run(job):
        prompt, n = job
        return stub.Generate(coordinator_pb2.GenerateRequest(prompt_token_ids=prompt, n=n, max_new_tokens=MAX_NEW,
                                                             ignore_eos=True), timeout=300)

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(run, jobs))


def repeating_jobs() -> list[tuple[list[int], int]]:
    """Prompts that repeat themselves (so lookup has continuations from the first round), 1 or 3 samples."""
    return [(prompt * 3, (1, 3)[i % 2]) for i, prompt in enumerate(prompts()[1:])]


def test_lookup_rounds_without_a_draft_give_hf_greedy_output(deployments, checkpoints):
    """Target only, the coordinator's defaults: lookup tokens are proposed and accepted, the output is HF's
    and the same as with ``--prompt-lookup off``, where every round is a plain decode step."""
    jobs = repeating_jobs()
    on = generate_all(coordinator_stub(deployments("llama", None).coordinator_address), jobs)
    off = generate_all(coordinator_stub(deployments("llama", None, "--prompt-lookup", "off").coordinator_address),
                       jobs)
    for (prompt, _), with_lookup, without in zip(jobs, on, off, strict=True):
        expected = greedy(checkpoints["llama"], prompt, MAX_NEW, None)
        assert all(list(c.token_ids) == expected for c in with_lookup.completions)
        assert all(list(c.token_ids) == expected for c in without.completions)
        assert with_lookup.usage.draft_tokens_proposed == 0
        assert with_lookup.usage.rounds == with_lookup.usage.lookup_rounds + with_lookup.usage.plain_rounds
        assert without.usage.lookup_rounds == without.usage.lookup_tokens_proposed == 0
        assert without.usage.plain_rounds == without.usage.rounds
    usage = [r.usage for r in on]
    assert sum(u.lookup_tokens_accepted for u in usage) > 0
    assert sum(u.rounds for u in usage) < sum(u.rounds for u in (r.usage for r in off))  # fewer rounds


def test_a_draft_catches_up_on_what_lookup_rounds_accepted(deployments, checkpoints):
    """With the gate on and probes from every 2nd round, draft-free rounds run between draft rounds and verify
    lookup tokens; the draft (the target itself) hears of the accepted ones as catch-up, so nearly all it
    proposes is still accepted, and the output is HF's. (Which kind each round is depends on the measured
    speeds, so the counts are summed over the requests.)"""
    deployment = deployments("llama", "llama", "--speculation-gate", "--speculation-probe-every", "2")
    jobs = repeating_jobs()
    responses = generate_all(coordinator_stub(deployment.coordinator_address), jobs)
    for (prompt, _), response in zip(jobs, responses, strict=True):
        expected = greedy(checkpoints["llama"], prompt, MAX_NEW, None)
        assert all(list(c.token_ids) == expected for c in response.completions)
    usage = [r.usage for r in responses]
    assert sum(u.draft_tokens_accepted for u in usage) >= 0.9 * sum(u.draft_tokens_proposed for u in usage) > 0
    assert sum(u.lookup_tokens_accepted for u in usage) > 0


@pytest.fixture(scope="module")
def sampling_deployment(tmp_path_factory):
    """A 32-token tiny target alone, the coordinator's lookup over 1-grams, room for SAMPLES samples."""
    root = tmp_path_factory.mktemp("lookup-sampling")
    deployment = Deployment(str(tiny(root / "target", seed=10, scale=12.0)), None, log_dir=root,
                            coordinator_args=["--prompt-lookup", "1,1", "--max-n", str(SAMPLES),
                                              "--max-batch-sequences", str(SAMPLES)]).start()
    yield deployment, root / "target"
    deployment.stop()


def test_lookup_rounds_keep_the_target_distribution(sampling_deployment):
    """Every token but EOS occurs in the prompt, so each sample's first token has a 1-gram continuation:
    its second token is proposed by lookup with a point distribution (accepted with probability p(x), else
    drawn from p without x), the third is the target's. (t1, t2, t3) over SAMPLES samples must pass a
    chi-square test against the exact distribution."""
    deployment, path = sampling_deployment
    prompt = list(range(1, VOCAB)) + [5]
    request = coordinator_pb2.GenerateRequest(prompt_token_ids=prompt, n=SAMPLES, max_new_tokens=3, temperature=1.0,
                                              seed=5, ignore_eos=True)
    response = coordinator_stub(deployment.coordinator_address).Generate(request, timeout=600)
    assert response.usage.lookup_tokens_proposed > SAMPLES / 2, "lookup proposed too rarely to be tested"
    assert 0 < response.usage.lookup_tokens_accepted < response.usage.lookup_tokens_proposed
    samples = torch.tensor([list(c.token_ids) for c in response.completions])
    model = LlamaForCausalLM.from_pretrained(path).eval()
    exact = exact_distribution(model, SamplingParams(temperature=1.0), prompt)
    assert chi_square_pvalue(samples, exact) > ALPHA

