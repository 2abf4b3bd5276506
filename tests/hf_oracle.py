"""The independent oracle: HF transformers generate() on the target model alone."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


@lru_cache(maxsize=8)
def load(path: Path) -> torch.nn.Module:
    """The checkpoint loaded by plain transformers."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def greedy(path: Path, prompt: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    """HF greedy continuation of ``prompt``, cut after the first EOS when ``eos`` is given."""
    model = load(path)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=0)[0, len(prompt):].tolist()
    if eos is not None and eos in out:
        out = out[: out.index(eos) + 1]
    return out
