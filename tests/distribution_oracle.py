"""An exact oracle for sampled output: a tiny Llama with a 32-token vocabulary, the exact distribution of its
first three sampled tokens by enumeration, and a chi-square test of samples against it."""

from __future__ import annotations

import itertools

import torch
from scipy import stats
from transformers import LlamaConfig, LlamaForCausalLM

from engine.sampling import SamplingParams, process_logits

VOCAB = 32


def tiny(path, seed: int, scale: float):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         eos_token_id=0, bos_token_id=1))
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(path, safe_serialization=True)
    return path


def exact_distribution(model, params: SamplingParams, prompt_ids: list[int]) -> torch.Tensor:
    """P(t1, t2, t3) [V, V, V] of the target's processed distributions, by enumeration."""
    with torch.inference_mode():
        prompt = torch.tensor([prompt_ids])
        p1 = process_logits(model(prompt).logits[:, -1], [params])[0]
        pairs = torch.tensor(list(itertools.product(range(VOCAB), repeat=2)))
        logits = model(torch.cat([prompt.expand(len(pairs), -1), pairs], dim=1)).logits
        p2 = process_logits(logits[::VOCAB, -2], [params] * VOCAB)  # [V, V]: depends on t1 only
        p3 = process_logits(logits[:, -1], [params] * len(pairs)).view(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


def pair_pvalue(samples: torch.Tensor, exact: torch.Tensor, merge_below: float = 5.0) -> float:
    """Chi-square p-value of the counts of token pairs ``samples [N, 2]`` against ``exact [V, V]``; cells with
    expected count below ``merge_below`` are pooled into one."""
    counts = torch.zeros(exact.numel(), dtype=torch.float64)
    flat = samples[:, 0] * VOCAB + samples[:, 1]
    counts.index_add_(0, flat, torch.ones(len(flat), dtype=torch.float64))
    expected = exact.flatten().double() / exact.sum().double() * len(flat)
    assert float(counts[expected == 0].sum()) == 0, "a sample the target gives probability 0"
    big = expected >= merge_below
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    wanted = torch.cat([expected[big], expected[~big].sum()[None]])
    assert int(big.sum()) >= 20, "too few cells for a meaningful test"
    wanted = wanted * observed.sum() / wanted.sum()
    return float(stats.chisquare(observed.numpy(), wanted.numpy()).pvalue)


def chi_square_pvalue(samples: torch.Tensor, exact: torch.Tensor) -> float:
    """The smaller p-value of the (t1, t2) and (t2, t3) pair tests, Bonferroni-corrected (x2)."""
    first = pair_pvalue(samples[:, :2], exact.sum(dim=2))
    second = pair_pvalue(samples[:, 1:], exact.sum(dim=0))
    return min(1.0, 2 * min(first, second))
