"""Prompt-lookup proposals: the n-gram index against a brute-force search, and greedy BASS with lookup on
equal to HF greedy decoding of the target (lookup tokens proposed and accepted, the output unchanged)."""

from __future__ import annotations

import random

import pytest
import torch
from hf_oracle import greedy

import engine.draft
from bench.speculative import engine_bass
from coordinator.draft_length import DraftLength
from engine.batch import SequenceState
from engine.checkpoint import load_checkpoint
from engine.draft import DraftRuntime, apply_verdict
from engine.prompt_lookup import LookupScore, PromptLookup, PromptNgrams
from engine.sampling import SamplingParams
from engine.target import TargetRuntime


def brute_force(context: list[int], count: int, min_n: int, max_n: int) -> list[int]:
    """The continuation of the latest earlier occurrence of the longest tail of max_n..min_n tokens."""
    for n in range(max_n, min_n - 1, -1):
        if len(context) < n:
            continue
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == tail:
                return context[start + n:start + n + count]
    return []


def test_lookup_equals_a_brute_force_search():
    rng = random.Random(0)
    hits = 0
    for _ in range(400):
        vocab = rng.choice([2, 3, 5, 20])
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 4)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        lookup = PromptLookup(PromptNgrams(prompt, min_n, max_n), LookupScore())
        context = list(prompt)
        for _ in range(10):
            count = rng.randint(0, 5)
            expected = brute_force(context, count, min_n, max_n)
            assert lookup.propose(count) == expected, (prompt, context, count, min_n, max_n)
            hits += bool(expected)
            new = [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
            lookup.extend(new)
            context += new
    assert hits > 500  # most cases found a continuation, across the prompt/generated boundary too


def test_a_lookup_only_proposal_stops_at_the_confidence_floor_and_is_scored_whole():
    """``confident`` keeps the tokens while confidence ** length >= floor (prior 3/4: 4 tokens at 0.3), and
    ``settle`` scores the whole continuation, so a group whose proposals were cut to nothing regains them."""
    lookup = PromptLookup(PromptNgrams([1, 2, 3, 4, 5, 6, 7, 8, 1, 2], 2, 2), LookupScore())
    assert lookup.propose(8) == [3, 4, 5, 6, 7, 8, 1, 2]
    assert lookup.confident(8, 0.3) == [3, 4, 5, 6]  # 0.75 ** 4 = 0.32 >= 0.3 > 0.75 ** 5
    assert lookup.confident(2, 0.3) == [3, 4]
    assert lookup.confident(8, 0.0) == [3, 4, 5, 6, 7, 8, 1, 2]
    lookup.advance([9])  # the target disagreed at once: 1 tried, 0 accepted -> confidence 3/5
    assert lookup.score.lookup_confidence == pytest.approx(3 / 5)
    lookup.extend([1, 2])
    assert lookup.confident(8, 0.7) == []  # 0.6 < 0.7: nothing proposed, yet scored:
    lookup.settle([9, 1])  # the target confirmed what lookup found ([9, 1, 2] follows 1, 2 now)
    assert (lookup.score.lookup_accepted, lookup.score.lookup_tried) == (2, 3)
    assert lookup.score.lookup_confidence == pytest.approx(5 / 7)
    assert lookup.confident(8, 0.7) == [9]


def test_ngram_sizes_are_checked():
    with pytest.raises(ValueError, match="min_n"):
        PromptNgrams([1, 2], 3, 2)


@pytest.mark.parametrize("sizes", [(1, 3), (2, 3)])
def test_greedy_bass_with_lookup_equals_hf(checkpoints, monkeypatch, sizes):
    target = TargetRuntime(load_checkpoint(checkpoints["llama"]))
    draft = DraftRuntime(load_checkpoint(checkpoints["llama_draft"]), prompt_lookup=sizes)
    found = []
    propose = engine.draft.PromptLookup.propose
    monkeypatch.setattr(engine.draft.PromptLookup, "propose",
                        lambda self, count: found.append(len(out := propose(self, count))) or out)
    led = []
    draft_propose = draft.propose

    def counting_propose(*args, **kwargs):
        proposals = draft_propose(*args, **kwargs)
        led.extend(p.lookup_tokens for p in proposals)
        return proposals

    monkeypatch.setattr(draft, "propose", counting_propose)
    prompt = [7, 30, 31, 9, 40, 7, 30, 31, 9, 40, 7, 30]  # a repeating prompt, as code often is
    outputs, stats = engine_bass(target, draft, prompt, 3, SamplingParams(), 32, DraftLength(4, 4, adaptive=False))
    expected = greedy(checkpoints["llama"], prompt, 32, None)
    assert outputs == [expected] * 3
    assert sum(found) > 0 and sum(led) > 0  # lookup found continuations, and led proposals with them
    model_only = DraftRuntime(draft.checkpoint, prompt_lookup=None)
    _, alone = engine_bass(target, model_only, prompt, 3, SamplingParams(), 32, DraftLength(4, 4, adaptive=False))
    assert stats.accepted > alone.accepted  # the lookup tokens were right where the random draft is not


def test_lookup_off_proposes_with_the_model_alone(checkpoints, monkeypatch):
    draft = DraftRuntime(load_checkpoint(checkpoints["llama_draft"]), prompt_lookup=None)
    target = TargetRuntime(load_checkpoint(checkpoints["llama"]))
    monkeypatch.setattr(engine.draft.PromptLookup, "propose", lambda self, count: pytest.fail("lookup ran"))
    prompt = [7, 30, 31, 9, 40, 7, 30]
    outputs, _ = engine_bass(target, draft, prompt, 2, SamplingParams(), 12, DraftLength(3, 3, adaptive=False))
    assert outputs == [greedy(checkpoints["llama"], prompt, 12, None)] * 2


def test_lookup_leads_only_once_it_beat_the_model():
    score = LookupScore()
    first, second = (PromptLookup(PromptNgrams([1, 2, 3, 1, 2], 2, 2), score) for _ in range(2))
    found = first.propose(2)
    assert found == [3, 1]
    assert first.choose(found, model_first=9) == []  # no evidence yet: the model proposes
    first.settle([3])  # the target confirmed the lookup's token
    assert (score.lookup_right, score.model_right) == (1, 0)
    assert second.choose(found, model_first=9) == found  # the score is the group's
    second.settle([9])
    assert second.choose(found, model_first=9) == []  # 1:1 is a tie: the model again
    second.settle(None)  # unknown outcome: not scored
    assert first.choose(found, model_first=3) == []  # no disagreement, nothing to score
    first.settle([3])
    assert (score.lookup_right, score.model_right) == (1, 1)


def test_lookup_confidence_scores_continuations_proposed_or_not():
    score = LookupScore()
    lookup = PromptLookup(PromptNgrams([1, 2, 3, 1, 2], 2, 2), score)
    found = lookup.propose(2)
    assert found == [3, 1] and lookup.choose(found, model_first=3) == []  # the model proposes ...
    lookup.settle([3, 5])  # ... and the continuation is scored all the same: 3 confirmed, then 1 is not
    assert (score.lookup_accepted, score.lookup_tried) == (1, 2)
    assert score.lookup_confidence == pytest.approx((1 + 3) / (2 + 4))
    lookup.settle([3])  # no proposal since: nothing to score
    assert score.lookup_tried == 2


def test_advance_scores_the_proposal_and_extends_the_context():
    """``advance`` is ``settle`` then ``extend``."""
    lookup = PromptLookup(PromptNgrams([1, 2, 3, 1, 2], 2, 2), LookupScore())
    assert lookup.confident(4, 0.0) == [3, 1, 2]
    lookup.advance([7, 1, 2])
    assert (lookup.score.lookup_accepted, lookup.score.lookup_tried) == (0, 1)
    assert len(lookup) == 8 and lookup.propose(2) == [7, 1]  # [1, 2] last followed by 7 now


def test_the_draft_scores_its_last_proposal_after_rounds_it_skipped():
    """Rounds without the draft reach it as catch-up tokens, which continue the text right where its last
    proposal stopped matching, so that proposal is scored on them (it went unscored before)."""
    lookup = PromptLookup(PromptNgrams([1, 2, 3, 1, 2], 2, 2), LookupScore())
    found = lookup.propose(4)
    assert found == [3, 1, 2]
    lookup.choose(found, model_first=9)  # the draft model would have begun with 9
    state = SequenceState(1, 0, SamplingParams(), torch.Generator(), decoded=2, proposed=[3, 1, 2], lookup=lookup)
    # the target took 3, corrected 1 to 5; two skipped rounds confirmed 6, 7, and now 8
    apply_verdict(state, 1, 8, catch_up=[5, 6, 7])
    score = lookup.score
    assert (score.lookup_right, score.model_right) == (1, 0)
    assert (score.lookup_accepted, score.lookup_tried) == (1, 2)
    assert state.pending == [5, 6, 7, 8] and state.decoded == 1
    assert lookup.generated == [3, 5, 6, 7, 8]
