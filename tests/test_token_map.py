"""A draft over a subset of the target's vocabulary (engine.token_map) is served as a full-vocabulary draft.

The oracle is plain HF transformers on the restricted checkpoint: target ids are looked up in the map by hand,
the logits of the catch-all row are dropped, and the best remaining row is mapped back to its target id.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from hf_oracle import greedy
from transformers import AutoModelForCausalLM

from bench.speculative import hf_assistant, hf_assisted
from engine.batch import GroupInput
from engine.checkpoint import CheckpointError, load_checkpoint
from engine.draft import DraftRuntime
from engine.sampling import SamplingParams
from engine.token_map import CATCH_ALL, TOKEN_MAP_FILE, TokenMap, TokenMapError

SUBSET = list(range(288))  # conftest's llama_subset: of the tiny tokenizer's 384 ids, specials, bytes, first merges
PROMPTS = {0: [5, 9, 140, 3, 301, 21, 8, 8, 350], 1: [40, 41]}  # 301 and 350 are outside the subset


@pytest.fixture(scope="module")
def restricted(checkpoints):
    return checkpoints["llama_subset"]


def oracle_logits(path, ids: list[int]) -> torch.Tensor:
    """The restricted model's last-position logits over the target vocabulary (-inf outside the subset)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    catch_all = len(SUBSET)
    rows = [SUBSET.index(t) if t in SUBSET else catch_all for t in ids]
    with torch.inference_mode():
        logits = model(torch.tensor([rows])).logits[0, -1]
    full = torch.full((384,), float("-inf"))
    full[torch.tensor(SUBSET)] = logits[:catch_all]
    return full


def test_map_round_trip_and_validation():
    token_map = TokenMap(torch.tensor([4, 0, CATCH_ALL, 7]), target_vocab_size=10)
    assert token_map.draft_vocab_size == 4 and token_map.catch_all_row == 2
    assert token_map.to_draft(torch.tensor([[0, 4, 7, 5]])).tolist() == [[1, 0, 3, 2]]
    logits = token_map.to_target_logits(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    assert logits.shape == (1, 10)
    assert logits[0, [4, 0, 7]].tolist() == [1.0, 2.0, 4.0]
    assert torch.isinf(logits[0, [1, 2, 3, 5, 6, 8, 9]]).all()
    for bad in ([1, 1], [0, 10], [CATCH_ALL, 0, CATCH_ALL]):
        with pytest.raises(TokenMapError):
            TokenMap(torch.tensor(bad), target_vocab_size=10)


def test_map_that_does_not_fit_the_model_is_refused(restricted, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(restricted, broken)
    TokenMap(torch.tensor([0, 1, CATCH_ALL]), 384).save(broken)
    with pytest.raises(CheckpointError, match="rows"):
        load_checkpoint(broken)
    (broken / TOKEN_MAP_FILE).write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(broken)


def test_checkpoint_reports_the_target_vocabulary(restricted, checkpoints):
    draft, target = load_checkpoint(restricted), load_checkpoint(checkpoints["llama"])
    assert draft.token_map is not None and draft.token_map.draft_vocab_size == len(SUBSET) + 1
    assert draft.vocab_size == target.vocab_size == 384
    assert draft.vocab_fingerprint() == target.vocab_fingerprint()


def test_greedy_proposals_match_the_oracle(restricted):
    draft = DraftRuntime(load_checkpoint(restricted), confidence_floor=0.0)  # exactly draft_len tokens
    groups = [GroupInput(g, prompt, [g], SamplingParams(), 16) for g, prompt in PROMPTS.items()]
    draft.prefill("b", groups)
    proposals = draft.propose("b", {g: (0, 7 if g else 333, []) for g in PROMPTS}, draft_len=4)
    for proposal in proposals:
        context = PROMPTS[proposal.sequence_id] + [7 if proposal.sequence_id else 333]
        expected = []
        for _ in range(4):
            expected.append(int(oracle_logits(restricted, context + expected).argmax()))
        assert proposal.token_ids == expected
        assert all(t in SUBSET for t in proposal.token_ids)


def test_sampled_distributions_live_on_the_subset(restricted):
    draft = DraftRuntime(load_checkpoint(restricted), confidence_floor=0.0)  # exactly draft_len tokens
    prompt = PROMPTS[0]
    draft.prefill("s", [GroupInput(0, prompt, [0], SamplingParams(temperature=1.0, seed=3), 16)])
    (proposal,) = draft.propose("s", {0: (0, 301, [])}, draft_len=1)
    (dist,) = proposal.distributions
    assert set(dist.token_ids.tolist()) <= set(SUBSET)
    expected = torch.softmax(oracle_logits(restricted, prompt + [301]), -1)
    dense = dist.to_dense(384)
    assert torch.allclose(dense, expected, atol=2e-3)
    assert dense[torch.tensor(SUBSET)].sum() == pytest.approx(1.0, abs=1e-6)


def test_hf_assistant_view_serves_the_same_distribution(restricted, checkpoints):
    """The benchmark's HF view of a subset draft has the oracle's logits, and HF assisted generation with it
    reproduces the target's greedy output."""
    view = hf_assistant(load_checkpoint(restricted, packed_linears=False))
    ids = PROMPTS[0] + [301]
    with torch.inference_mode():
        logits = view(torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(logits, oracle_logits(restricted, ids), atol=1e-5)
    target = load_checkpoint(checkpoints["llama"], packed_linears=False)
    samples, _ = hf_assisted(target.model, view, PROMPTS[0], 1, 0.0, 12, seed=0)
    assert samples == [greedy(checkpoints["llama"], PROMPTS[0], 12, None)]
