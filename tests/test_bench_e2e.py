"""`specserve bench e2e` on tiny random models: every system reports positive numbers, and greedy outputs of
the engine, in-process BASS, BASS over gRPC and HF generate are token-identical (and equal HF greedy)."""

from __future__ import annotations

import json

from hf_oracle import greedy

from bench.e2e import SYSTEMS
from bench.prompts import code_prompts, is_heldout, training_script
from specserve.cli import main


def test_bench_e2e_json(checkpoints, tmp_path):
    out = tmp_path / "out.json"
    md = tmp_path / "out.md"
    status = main(["bench", "e2e", "--target-model", str(checkpoints["llama"]),
                   "--draft-model", str(checkpoints["llama_draft"]), "--n", "1,2", "--temperatures", "0",
                   "--prompts", "1", "--repeats", "1", "--max-new-tokens", "8", "--bandwidth-mb", "16",
                   "--no-progress", "--json", str(out), "--markdown", str(md)])
    assert status == 0
    result = json.loads(out.read_text())
    assert [p["n"] for p in result["points"]] == [1, 2]
    prompt = result["prompts"][0]
    assert is_heldout(prompt["file"]) and prompt["tokens"] > 0
    for point in result["points"]:
        systems = point["systems"]
        assert set(systems) == set(SYSTEMS)
        for entry in systems.values():
            assert entry["wall_s"] > 0 and entry["per_token_ms"] > 0 and entry["tokens_per_s"] > 0
            assert len(entry["outputs"]) == 1 and len(entry["outputs"][0]) == point["n"]
            assert all(len(sample) == 8 for sample in entry["outputs"][0])
        reference = systems["a_batched"]["outputs"]
        for name in ("b_hf_generate", "d_bass_fixed", "d_bass_adaptive", "d_bass_full_proposals", "d_bass_model_only",
                     "d_bass_gated", "e_grpc_adaptive", "e_grpc_sampled_gate", "e_grpc_default", "e_grpc_lookup",
                     "e_grpc_target"):
            assert systems[name]["outputs"] == reference, name
        assert point["grpc_overhead"] > -1
    prompt_ids = code_prompts(_tokenizer(checkpoints["llama"]), 1)[0].token_ids
    assert len(prompt_ids) == prompt["tokens"]
    hf = greedy(checkpoints["llama"], prompt_ids, 8, None)
    assert result["points"][0]["systems"]["a_batched"]["outputs"][0][0] == hf
    assert result["roofline"]["bandwidth_gb_s"] > 0
    assert all(row["achieved_fraction"] > 0 for row in result["roofline"]["points"])
    assert result["budget"][0]["systems"]["a_batched"]["finished"] >= 0
    text = md.read_text()
    assert "End-to-end" not in text and "| n |" in text
    ratios = text.split("**Ratios, greedy**")[1].split("\n\n")[1].splitlines()  # header, rule, one row per n
    assert all(f"`{name}` vs (e)" in ratios[0] for name in SYSTEMS if name.startswith("e_") and name != "e_grpc_target")
    assert len(ratios) == 4 and len({line.count("|") for line in ratios}) == 1


def test_prompts_use_the_training_split():
    script = training_script()
    assert script is not None  # source checkout: the training script's own split and prompt rule
    for rel in ("base64.py", "copy.py", "difflib.py", "os.py", "json/decoder.py"):
        assert is_heldout(rel) == script.is_heldout(rel)


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
