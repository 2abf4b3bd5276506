"""Groups and a plain greedy decode loop shared by the runtime tests of the CPU and the GPU path."""

from __future__ import annotations

from engine.batch import GroupInput
from engine.sampling import SamplingParams
from engine.target import TargetRuntime

PROMPTS = {0: [5, 9, 14, 3, 77, 21, 8, 8, 30], 1: [40, 41]}


def groups(samples: int = 3, max_new_tokens: int = 16) -> list[GroupInput]:
    """Two groups of different prompt lengths; group g's sequence ids are 10 g + i."""
    return [GroupInput(g, prompt, [10 * g + i for i in range(samples if g == 0 else 1)], SamplingParams(),
                       max_new_tokens) for g, prompt in PROMPTS.items()]


def greedy_decode(runtime: TargetRuntime, steps: int) -> dict[int, list[int]]:
    """First tokens and ``steps`` plain decode steps (empty proposals) of the groups, per sequence id."""
    out = {sid: [token] for sid, token in runtime.prefill("b", groups()).first_tokens.items()}
    for _ in range(steps):
        for verdict in runtime.verify("b", {sid: ([], []) for sid in out}):
            out[verdict.sequence_id].append(verdict.next_token_id)
    return out
