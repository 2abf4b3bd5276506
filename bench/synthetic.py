"""A synthetic-weights checkpoint of Llama shape for benchmarks that need a longer context than the
default models are worth running at on a CPU: random weights, the default pair's tokenizer, saved with
``save_pretrained`` (safetensors) so the services load it like any other checkpoint."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from engine.default_models import DRAFT_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class LlamaShape:
    """Sizes of a Llama decoder (grouped-query attention: ``heads`` query heads over ``kv_heads``)."""

    hidden: int = 512
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 1536
    max_positions: int = 16384


def save_synthetic_llama(directory: Path, shape: LlamaShape, seed: int = 0) -> Path:
    """Write a randomly initialised ``LlamaForCausalLM`` of ``shape`` (seeded, so reproducible) with the
    default draft's tokenizer (the default target's vocabulary) to ``directory``; returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = len(AutoTokenizer.from_pretrained(DRAFT_DIR))
    config = LlamaConfig(vocab_size=vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.max_positions,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(DRAFT_DIR / name, directory / name)
    return directory
