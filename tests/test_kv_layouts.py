"""Both KV layouts keep decoding exactly while sequences and whole groups leave the batch, and the
bifurcated layout stores a group's prompt once."""

from __future__ import annotations

import pytest
from hf_oracle import greedy

from engine.batch import GroupInput
from engine.checkpoint import load_checkpoint
from engine.sampling import SamplingParams
from engine.target import TargetRuntime

PROMPTS = {0: [5, 9, 14, 3, 77, 21], 1: [40, 41], 2: [8] * 30}


@pytest.mark.parametrize("attention", ["bifurcated", "standard"])
def test_release_mid_generation_keeps_the_rest_exact(checkpoints, attention):
    runtime = TargetRuntime(load_checkpoint(checkpoints["qwen2"]), attention=attention)
    groups = [GroupInput(g, prompt, [10 * g + i for i in range(3)], SamplingParams(), max_new_tokens=40)
              for g, prompt in PROMPTS.items()]
    first = runtime.prefill("b", groups[:2]).first_tokens
    first.update(runtime.prefill("b", groups[2:]).first_tokens)  # a group joining an existing batch
    out = {sid: [token] for sid, token in first.items()}
    live = set(out)
    for step in range(24):
        if step == 5:  # one sample of group 0 and all of group 1 leave
            runtime.release("b", [1, 10, 11, 12])
            live -= {1, 10, 11, 12}
        verdicts = runtime.verify("b", {sid: ([], []) for sid in live})
        for verdict in verdicts:
            out[verdict.sequence_id].append(verdict.next_token_id)
    for g, prompt in PROMPTS.items():
        expected = greedy(checkpoints["qwen2"], prompt, 25, None)
        for sid in (10 * g + i for i in range(3)):
            assert out[sid] == expected[: len(out[sid])]
    assert runtime.stats()["sequences"] == 5
    assert runtime.release("b") == 5 and runtime.stats()["batches"] == 0


def test_bifurcated_prompt_kv_is_stored_once(checkpoints):
    prompt = list(range(3, 203))
    sizes = {}
    for attention in ("bifurcated", "standard"):
        runtime = TargetRuntime(load_checkpoint(checkpoints["llama"]), attention=attention)
        runtime.prefill("b", [GroupInput(0, prompt, list(range(16)), SamplingParams(), max_new_tokens=4)])
        sizes[attention] = runtime.stats()["kv_bytes"]
    prompt_bytes = len(prompt) * runtime.token_kv_bytes
    assert sizes["standard"] >= 16 * prompt_bytes
    assert sizes["bifurcated"] < 2 * prompt_bytes
