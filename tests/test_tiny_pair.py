"""The embedded tiny draft/target pair (models/tiny, the fast suite's) loads and runs with plain transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.batch import GroupInput, pad_windows
from engine.checkpoint import load_checkpoint
from engine.sampling import SamplingParams
from engine.target import TargetRuntime

ROOT = Path(__file__).resolve().parents[1] / "models" / "tiny"
TARGET, DRAFT = ROOT / "target", ROOT / "draft"

# Code in the style of the held-out corpus (Python stdlib source), with tabs, blank lines and non-ASCII.
SNIPPET = '''import os


class Walker:
    """Walk a tree.  Ünïcode is fine\u2014so are tabs:\tand trailing spaces.   """

    def __init__(self, root, *, follow=False):
        self.root = os.fspath(root)
        self._follow = follow

    def walk(self):
        for dirpath, dirnames, filenames in os.walk(self.root, followlinks=self._follow):
            dirnames.sort()
            yield dirpath, sorted(filenames)
\r\n'''

DEF_PROMPT = '''def _split_lines(text, width):
    """Split *text* into lines of at most *width* characters."""
'''


@pytest.fixture(scope="module")
def tokenizers():
    return AutoTokenizer.from_pretrained(TARGET), AutoTokenizer.from_pretrained(DRAFT)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(TARGET).eval()
    draft = AutoModelForCausalLM.from_pretrained(DRAFT).eval()
    return target, draft


def test_files_present():
    for d in (TARGET, DRAFT):
        for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json", "special_tokens_map.json"):
            assert (d / name).is_file(), f"missing {d / name}"
    metrics = json.loads((ROOT / "metrics.json").read_text())
    assert 0.0 <= metrics["acceptance"]["acceptance_rate"] <= 1.0


def test_identical_vocabulary(tokenizers):
    tt, dt = tokenizers
    assert tt.get_vocab() == dt.get_vocab()
    assert (TARGET / "tokenizer.json").read_bytes() == (DRAFT / "tokenizer.json").read_bytes()
    assert len(tt) == 4096


def test_special_tokens_match_configs(tokenizers, models):
    tok = tokenizers[0]
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == ("<s>", "</s>", "<unk>", "<pad>")
    for m in models:
        assert m.config.vocab_size == len(tok)
        assert m.config.bos_token_id == tok.bos_token_id
        assert m.config.eos_token_id == tok.eos_token_id
        assert m.config.pad_token_id == tok.pad_token_id
        assert m.generation_config.eos_token_id == tok.eos_token_id


def test_roundtrip_python_source(tokenizers):
    for tok in tokenizers:
        ids = tok(SNIPPET, add_special_tokens=False)["input_ids"]
        assert tok.eos_token_id not in ids and tok.bos_token_id not in ids
        assert tok.decode(ids) == SNIPPET
        # the default call adds no BOS/EOS either (no post-processor)
        assert tok(SNIPPET)["input_ids"] == ids


def test_target_larger_than_draft(models):
    target, draft = models
    nt = sum(p.numel() for p in target.parameters())
    nd = sum(p.numel() for p in draft.parameters())
    assert nt > 4 * nd
    assert target.config.num_hidden_layers > draft.config.num_hidden_layers
    assert target.config.hidden_size > draft.config.hidden_size


@torch.no_grad()
def test_forward_finite_logits(tokenizers, models):
    ids = torch.tensor([tokenizers[0](SNIPPET)["input_ids"]])
    for m in models:
        logits = m(input_ids=ids).logits
        assert logits.shape == (1, ids.shape[1], m.config.vocab_size)
        assert torch.isfinite(logits).all()


@torch.no_grad()
def test_greedy_generation_decodes(tokenizers, models):
    tok = tokenizers[0]
    ids = torch.tensor([tok(DEF_PROMPT)["input_ids"]])
    for m in models:
        out = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                         do_sample=False, pad_token_id=tok.pad_token_id)
        new = out[0, ids.shape[1]:]
        assert 0 < new.numel() <= 32
        text = tok.decode(new, skip_special_tokens=True)
        assert isinstance(text, str)


@pytest.mark.parametrize("path", [TARGET, DRAFT], ids=["target", "draft"])
@pytest.mark.parametrize("attention", ["bifurcated", "standard"])
def test_specserve_runtime_logits_match_transformers(path, attention, tokenizers):
    """specserve's own forward (prefill, then a ragged verify window over 3 samples) gives HF's logits."""
    ids = tokenizers[0](DEF_PROMPT)["input_ids"]
    runtime = TargetRuntime(load_checkpoint(path), attention=attention)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    prefix, window = ids[:-4], ids[-4:]
    logits, _, _ = runtime.decoder.prefill(prefix)
    with torch.inference_mode():
        reference = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(logits, reference[len(prefix) - 1], atol=1e-4, rtol=1e-4)
    runtime.prefill("b", [GroupInput(0, prefix, [0, 1, 2], SamplingParams(), max_new_tokens=8)])
    batch = runtime.get_batch("b")
    tokens, widths = pad_windows([window, window[:2], window[:1]])
    step = runtime.decoder.step(tokens, widths, batch.decoded(), batch.kv, last_only=False)
    for row, width in enumerate((4, 2, 1)):
        torch.testing.assert_close(step[row, :width], reference[len(prefix):len(prefix) + width], atol=1e-4,
                                   rtol=1e-4)
        assert not step[row, width:].any()  # the packed padding computed nothing
    last = runtime.decoder.step(tokens, widths, batch.decoded(), batch.kv, last_only=True)
    for row, width in enumerate((4, 2, 1)):
        torch.testing.assert_close(last[row], reference[len(prefix) + width - 1], atol=1e-4, rtol=1e-4)
