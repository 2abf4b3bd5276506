"""Sampling through the real draft and target runtimes has exactly the target model's distribution.

A tiny Llama target with a 32-token vocabulary and an unrelated draft; thousands of samples of one
prompt in one group (the prompt KV shared by all of them). The first token comes from the target's
prefill, tokens 2 and 3 from one speculative round (k=2; with a confidence floor, each sequence's proposal
holds 0, 1 or 2 tokens). The exact distribution of (t1, t2, t3) is
computed directly from the target model by enumeration; a chi-square test with a fixed seed (false-alarm
rate 1e-3) must accept it, and must reject it when the acceptance rule is broken.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from distribution_oracle import VOCAB, chi_square_pvalue, exact_distribution, tiny
from tiny_models import restrict_vocabulary

import engine.draft
import engine.prompt_lookup
import engine.sampling
from engine.batch import GroupInput
from engine.checkpoint import load_checkpoint
from engine.draft import DraftRuntime
from engine.sampling import SamplingParams
from engine.target import TargetRuntime
from specserve.cli import build_parser

SAMPLES = 6000
PROMPT = [3, 17, 5, 9]
ALPHA = 1e-3
FLOOR = 0.2  # with the peaked tiny draft below, proposals of 0, 1 and 2 tokens all occur


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("lossless")


@pytest.fixture(scope="module")
def pair(root):
    target = TargetRuntime(load_checkpoint(tiny(root / "target", seed=10, scale=12.0)))
    draft = DraftRuntime(load_checkpoint(tiny(root / "draft", seed=11, scale=8.0)), confidence_floor=0.0)
    return target, draft


@pytest.fixture(scope="module")
def floor_pair(pair, root):
    """The same target and a more peaked draft whose proposals stop below a confidence floor."""
    return pair[0], DraftRuntime(load_checkpoint(tiny(root / "draft-peaked", seed=11, scale=16.0)),
                                 confidence_floor=FLOOR)


@pytest.fixture(scope="module")
def subset_pair(pair, root):
    """The same target with the draft restricted to token ids 0..19: q is 0 on the other 12 ids."""
    restricted = restrict_vocabulary(tiny(root / "draft-full", seed=11, scale=8.0), root / "draft-subset",
                                     list(range(20)))
    return pair[0], DraftRuntime(load_checkpoint(restricted))


def speculative_samples(target, draft, params: SamplingParams, batch_id: str, prompt: list[int] = PROMPT,
                        lengths: Counter | None = None) -> torch.Tensor:
    """(t1, t2, t3) of SAMPLES sequences: t1 from prefill, then k=2 rounds until every sequence has 3; counts
    the proposals' lengths into ``lengths``."""
    ids = list(range(SAMPLES))
    group = GroupInput(0, prompt, ids, params, max_new_tokens=16)
    first = target.prefill(batch_id, [group]).first_tokens
    draft.prefill(batch_id, [group])
    tokens = {s: [first[s]] for s in ids}
    updates = {s: (0, first[s], []) for s in ids}
    while min(len(t) for t in tokens.values()) < 3:
        proposals = draft.propose(batch_id, updates, draft_len=2)
        verdicts = target.verify(batch_id, {p.sequence_id: (p.token_ids, p.distributions) for p in proposals})
        drafted = {p.sequence_id: p.token_ids for p in proposals}
        if lengths is not None:
            lengths.update(len(p.token_ids) for p in proposals)
        for verdict in verdicts:
            sid = verdict.sequence_id
            tokens[sid] += drafted[sid][: verdict.accepted_len] + [verdict.next_token_id]
            updates[sid] = (verdict.accepted_len, verdict.next_token_id, [])
    target.release(batch_id)
    draft.release(batch_id)
    return torch.tensor([tokens[s][:3] for s in ids])


CASES = [
    pytest.param(SamplingParams(temperature=1.0, seed=1), id="temperature-1"),
    pytest.param(SamplingParams(temperature=0.7, top_k=6, seed=2), id="top-k"),
    pytest.param(SamplingParams(temperature=1.2, top_p=0.8, seed=3), id="top-p"),
]


@pytest.mark.parametrize("params", CASES)
def test_speculative_sampling_has_the_target_distribution(pair, params):
    target, draft = pair
    samples = speculative_samples(target, draft, params, "exact")
    assert len(samples) == SAMPLES
    assert chi_square_pvalue(samples, exact_distribution(target.checkpoint.model, params, PROMPT)) > ALPHA


@pytest.mark.parametrize("params", CASES[::2])
def test_per_sequence_draft_lengths_keep_the_target_distribution(floor_pair, params):
    """Proposals cut short by the draft's confidence floor (ragged verify windows) stay exact."""
    target, draft = floor_pair
    lengths = Counter()
    samples = speculative_samples(target, draft, params, "floor", lengths=lengths)
    assert all(lengths[n] > SAMPLES // 20 for n in (0, 1, 2)), f"proposal lengths not varied enough: {lengths}"
    assert chi_square_pvalue(samples, exact_distribution(target.checkpoint.model, params, PROMPT)) > ALPHA


def test_subset_vocabulary_draft_keeps_the_target_distribution(subset_pair):
    """The target's tokens the draft cannot propose come only from corrections: still exact."""
    target, draft = subset_pair
    params = SamplingParams(temperature=1.0, seed=4)
    samples = speculative_samples(target, draft, params, "subset")
    assert (samples >= 20).any(), "no token outside the draft's subset: the correction path went untested"
    assert chi_square_pvalue(samples, exact_distribution(target.checkpoint.model, params, PROMPT)) > ALPHA


LOOKUP_PROMPT = list(range(1, VOCAB)) + [5]  # every token but EOS occurred, so every t1 has a lookup continuation


@pytest.fixture(scope="module")
def lookup_pair(pair, root):
    """The same target and draft model, the draft proposing prompt-lookup continuations of 1-grams first."""
    return pair[0], DraftRuntime(load_checkpoint(root / "draft"), prompt_lookup=(1, 1))


def lookup_samples(lookup_pair, params: SamplingParams, batch_id: str, monkeypatch) -> torch.Tensor:
    """``speculative_samples`` on LOOKUP_PROMPT with lookup trusted from the first round (the score starts
    in its favour), checking that most sequences were sent lookup tokens."""
    monkeypatch.setattr(engine.draft, "LookupScore", lambda: engine.prompt_lookup.LookupScore(lookup_right=1))
    sent = []
    point = engine.draft.point_distribution
    monkeypatch.setattr(engine.draft, "point_distribution", lambda token: sent.append(token) or point(token))
    samples = speculative_samples(*lookup_pair, params, batch_id, LOOKUP_PROMPT)
    assert len(sent) > SAMPLES / 2, "prompt lookup proposed too rarely to be tested"
    return samples


def test_prompt_lookup_keeps_the_target_distribution(lookup_pair, monkeypatch):
    """Lookup tokens go out with a point distribution: accepted with probability p(x), exact overall."""
    params = SamplingParams(temperature=1.0, seed=5)
    samples = lookup_samples(lookup_pair, params, "lookup", monkeypatch)
    exact = exact_distribution(lookup_pair[0].checkpoint.model, params, LOOKUP_PROMPT)
    assert chi_square_pvalue(samples, exact) > ALPHA


def test_lookup_tokens_sent_with_a_wrong_distribution_are_detected(lookup_pair, monkeypatch):
    """Claiming q = uniform for a lookup token (it was not drawn from it) biases the output."""
    params = SamplingParams(temperature=1.0, seed=5)
    uniform = engine.sampling.compact_distribution(torch.full((VOCAB,), 1.0 / VOCAB), max_support=VOCAB)
    monkeypatch.setattr(engine.draft, "point_distribution", lambda token: uniform)
    samples = lookup_samples(lookup_pair, params, "lookup-broken", monkeypatch)
    exact = exact_distribution(lookup_pair[0].checkpoint.model, params, LOOKUP_PROMPT)
    assert chi_square_pvalue(samples, exact) < ALPHA


def test_broken_correction_rule_is_detected(pair, monkeypatch):
    """Sampling the correction token from p instead of norm(max(0, p - q)) biases the output."""
    target, draft = pair
    params = CASES[0].values[0]
    monkeypatch.setattr(engine.sampling, "_residual", lambda p, q: p)
    samples = speculative_samples(target, draft, params, "broken")
    assert chi_square_pvalue(samples, exact_distribution(target.checkpoint.model, params, PROMPT)) < ALPHA


def test_same_seed_same_completions(pair):
    target, draft = pair
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    first = speculative_samples(target, draft, params, "a")
    again = speculative_samples(target, draft, params, "b")
    other = speculative_samples(target, draft, SamplingParams(temperature=0.9, top_p=0.95, seed=43), "c")
    assert torch.equal(first, again)
    assert not torch.equal(first, other)



@pytest.mark.parametrize("floor", [-0.1, 1.0])
def test_confidence_floor_is_checked(pair, floor):
    """The runtime and the ``serve draft`` flag refuse a floor outside [0, 1), with one message."""
    with pytest.raises(ValueError, match=r"confidence_floor must be in \[0, 1\)"):
        DraftRuntime(pair[1].checkpoint, confidence_floor=floor)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "draft", "--confidence-floor", str(floor)])


CACHED_PROMPT = [3, 17, 5, 9, 12, 4, 22, 8, 6]  # two whole 4-token blocks and one more token


def test_speculative_sampling_from_cached_prefixes_has_the_target_distribution(pair):
    """Draft and target both find the prompt's first 8 tokens in their prefix caches (an earlier request put
    them there) and prefill only the rest: the samples still have the target's exact distribution."""
    options = dict(prefix_cache_bytes=1 << 20, prefix_block_tokens=4)
    target = TargetRuntime(pair[0].checkpoint, **options)
    draft = DraftRuntime(pair[1].checkpoint, confidence_floor=0.0, **options)
    earlier = GroupInput(0, CACHED_PROMPT[:8] + [30], [0], SamplingParams(), max_new_tokens=4)
    for runtime in (target, draft):
        runtime.prefill("earlier", [earlier])
        runtime.release("earlier")
    params = SamplingParams(temperature=1.0, seed=9)
    samples = speculative_samples(target, draft, params, "cached", CACHED_PROMPT)
    for runtime in (target, draft):
        stats = runtime.stats()
        assert stats["prefix_cache_hit_tokens"] == 8, runtime.role
        assert stats["prefix_cache_refs"] == 0, runtime.role
    exact = exact_distribution(target.checkpoint.model, params, CACHED_PROMPT)
    assert chi_square_pvalue(samples, exact) > ALPHA
