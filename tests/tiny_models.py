"""Tiny random HF checkpoints with a real trained tokenizer, saved with save_pretrained for the tests."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engine.token_map import CATCH_ALL, TokenMap

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
EOS_ID = 2
# The random tiny models are not calibrated (top probabilities near 1/V): their draft services run with the
# confidence floor off, so every proposal is k long and speculation is exercised.
FIXED_K = ("--confidence-floor", "0")


def train_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few stdlib modules (offline, deterministic)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = [(stdlib / name).read_text(encoding="utf-8") for name in ("textwrap.py", "bisect.py", "heapq.py")]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def build_checkpoint(path: Path, tokenizer: PreTrainedTokenizerFast, family: str = "llama", seed: int = 0,
                     hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                     max_positions: int = 512) -> Path:
    """Save a randomly initialised model of ``family`` ("llama" or "qwen2") with the tokenizer at ``path``."""
    torch.manual_seed(seed)
    common = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=EOS_ID,
                  tie_word_embeddings=False)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))
    # Larger logits than the default init so greedy argmaxes are far from ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def restrict_vocabulary(source: Path, path: Path, subset: list[int]) -> Path:
    """Save at ``path`` a copy of the (untied) checkpoint ``source`` whose embedding and head keep only the rows
    of ``subset`` plus a catch-all row (the mean embedding), with the token map that serves it and the source's
    tokenizer: on a context of subset tokens its logits at subset ids are the source's exactly."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    rows = torch.tensor(subset)
    embedding = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings().weight.detach()
    config = model.config
    vocab = config.vocab_size
    config.vocab_size = len(subset) + 1
    restricted = type(model)(config)
    state = {k: v for k, v in model.state_dict().items() if k not in ("model.embed_tokens.weight", "lm_head.weight")}
    restricted.load_state_dict(state, strict=False)
    with torch.no_grad():
        restricted.get_input_embeddings().weight.copy_(torch.cat([embedding[rows], embedding.mean(0, keepdim=True)]))
        restricted.get_output_embeddings().weight.copy_(torch.cat([head[rows], head.mean(0, keepdim=True)]))
    restricted.save_pretrained(path, safe_serialization=True)
    if (source / "tokenizer.json").is_file():
        AutoTokenizer.from_pretrained(source).save_pretrained(path)
    TokenMap(torch.cat([rows, torch.tensor([CATCH_ALL])]), vocab).save(path)
    return path
