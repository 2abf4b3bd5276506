"""`specserve bench prefix` on a small synthetic Llama: prompt variants never share a block, the synthetic
checkpoint loads like any other, and a short run reports its rows with every hit served from the cache."""

from __future__ import annotations

import json

from bench.prefix import PromptSet
from bench.synthetic import LlamaShape, save_synthetic_llama
from engine.checkpoint import load_checkpoint
from engine.prefix_cache import block_hashes
from specserve.cli import main


def test_prompt_variants_share_no_block_and_questions_follow_them():
    corpus = list(range(1000))
    prompts = PromptSet(corpus, longest=128, variants=3, questions=4, question_tokens=10)
    keys = [{key for _, key in block_hashes(prompts.system(128, v), 16)} for v in range(3)]
    assert all(len(k) == 8 for k in keys) and not (keys[0] & keys[1]) and not (keys[1] & keys[2])
    assert prompts.system(128, 2) == corpus[2:130]
    assert prompts.questions[0] == corpus[131:141] and prompts.questions[3] == corpus[161:171]


def test_synthetic_llama_loads_with_the_default_vocabulary(tmp_path):
    shape = LlamaShape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, max_positions=4096)
    checkpoint = load_checkpoint(save_synthetic_llama(tmp_path / "m", shape))
    config = checkpoint.model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (64, 2, 2)
    assert checkpoint.vocab_size == config.vocab_size == 49152 and checkpoint.max_context == 4096
    assert checkpoint.tokenizer_json()


def test_bench_prefix_reports_hits_from_the_cache(tmp_path):
    out = tmp_path / "prefix.json"
    status = main(["bench", "prefix", "--system-tokens", "64", "--requests", "2", "--n", "2",
                   "--question-tokens", "8", "--max-new-tokens", "3", "--repeats", "1", "--hidden", "64",
                   "--layers", "2", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
                   "--json", str(out), "--plot", str(tmp_path / "prefix.png")])
    assert status == 0
    result = json.loads(out.read_text())
    assert [row["system_tokens"] for row in result["rows"]] == [64]
    for row in result["rows"]:
        assert row["tokens_per_s_on"] > 0 and row["tokens_per_s_off"] > 0
        assert row["ttft_hit_s_on"] > 0 and 0 <= row["identical_outputs"] <= 1
    assert result["rows"][0]["throughput_on_vs_shortest"] == 1
    assert (tmp_path / "prefix.png").stat().st_size > 0
