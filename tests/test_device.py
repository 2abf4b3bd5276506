"""Device, dtype and backend selection of the model services, and the pieces of the GPU path that run on a
CPU: bfloat16 weights and KV, the Triton backend (under TRITON_INTERPRET=1) driving a real model's verify
and propose, and the window bucketing the CUDA graphs use."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import coordinator_stub
from engine_cases import PROMPTS, greedy_decode, groups
from hf_oracle import greedy
from transformers import AutoModelForCausalLM

from engine.batch import pad_windows
from engine.checkpoint import CheckpointError, load_checkpoint, resolve_dtype
from engine.device import DeviceUnavailable, resolve_device
from engine.draft import DraftRuntime
from engine.graphs import bucket_width, bucketed_step, graphs_supported, pad_width
from engine.target import TargetRuntime
from kernels import backend_for_device
from serving.model_service import runtime_options
from specserve.cli import build_parser, main
from specserve.v1 import coordinator_pb2

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def serve_args(*flags: str) -> argparse.Namespace:
    """``serve target`` flags as the CLI parses them."""
    return build_parser().parse_args(["serve", "target", "--model", "unused", *flags])


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(DeviceUnavailable, match="not supported"):
        resolve_device("meta")
    with pytest.raises(DeviceUnavailable, match="unknown device"):
        resolve_device("gpu")


@no_cuda
def test_cuda_without_cuda_is_one_clear_line_at_start_up(checkpoints) -> None:
    with pytest.raises(DeviceUnavailable, match="use --device cpu"):
        resolve_device("cuda")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "target", "--model", str(checkpoints["llama"]), "--device", "cuda", "--port", "0"])
    message = str(exit_info.value.code)
    assert message.startswith("specserve serve target: --device cuda: no CUDA device") and "\n" not in message


def test_backend_and_graph_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert backend_for_device("auto", cpu) == "torch" and backend_for_device(None, cuda) == "triton"
    assert backend_for_device("torch", cuda) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="--attention-backend torch"):
        backend_for_device("triton", cpu)
    with pytest.raises(ValueError, match="unknown attention backend"):
        backend_for_device("cudnn", cpu)
    assert graphs_supported(cuda, "bifurcated", "triton") and graphs_supported(cuda, "standard", "torch")
    assert not graphs_supported(cuda, "bifurcated", "torch") and not graphs_supported(cpu, "standard", "torch")
    device, options = runtime_options(serve_args("--device", "cpu", "--kv-budget-mb", "2"))
    assert device == cpu
    assert options == {"attention": "bifurcated", "attention_backend": "torch", "cuda_graphs": None,
                       "kv_budget_bytes": 2 * 2**20, "session_ttl_s": 300.0, "prefix_cache_bytes": 1024 * 2**20}
    assert runtime_options(serve_args("--device", "cpu", "--prefix-cache-mb", "0"))[1]["prefix_cache_bytes"] == 0
    with pytest.raises(ValueError, match="--cuda-graphs on needs --device cuda"):
        runtime_options(serve_args("--device", "cpu", "--cuda-graphs", "on"))


def test_bucket_width_and_padding() -> None:
    assert [bucket_width(w) for w in (1, 2, 3, 5, 9, 32, 33)] == [1, 2, 4, 8, 16, 32, 33]
    with pytest.raises(ValueError):
        bucket_width(0)
    tokens = torch.tensor([[4, 5, 6], [7, 0, 0]])
    assert pad_width(tokens, 3) is tokens
    assert pad_width(tokens, 4).tolist() == [[4, 5, 6, 0], [7, 0, 0, 0]]
    with pytest.raises(ValueError):
        pad_width(tokens, 2)


def twin_batches(runtime: TargetRuntime) -> None:
    """Batches "a" and "b" of ``runtime`` holding the same groups."""
    for batch_id in ("a", "b"):
        runtime.prefill(batch_id, groups())


@pytest.mark.parametrize("attention", ["bifurcated", "standard"])
def test_bucketed_step_equals_the_unpadded_step(checkpoints, attention: str) -> None:
    """Padding a window to its bucket (what the CUDA graphs replay) changes no logit and no cached KV."""
    runtime = TargetRuntime(load_checkpoint(checkpoints["llama"]), attention=attention)
    twin_batches(runtime)
    a, b = runtime.batches["a"], runtime.batches["b"]
    for windows in ([[3, 4, 5], [6], [7, 8], [9, 10, 11]], [[12], [13], [14], [15]]):
        tokens, widths = pad_windows(windows)
        plain = runtime.decoder.step(tokens, widths, a.decoded(), a.kv, last_only=False)
        padded = bucketed_step(runtime.decoder, tokens, widths, b.decoded(), b.kv, last_only=False)
        assert padded.shape == plain.shape
        real = torch.arange(tokens.shape[1])[None, :] < widths[:, None]  # padding logits are unspecified
        torch.testing.assert_close(padded[real], plain[real], atol=1e-5, rtol=1e-5)
        for batch in (a, b):
            for state, width in zip(batch.sequences, widths.tolist(), strict=True):
                state.decoded += width


def test_bfloat16_weights_and_kv_on_cpu(checkpoints) -> None:
    runtime = TargetRuntime(load_checkpoint(checkpoints["llama"], "bfloat16", "cpu"))
    fp32 = TargetRuntime(load_checkpoint(checkpoints["llama"]))
    assert runtime.decoder.dtype == torch.bfloat16 and 2 * runtime.token_kv_bytes == fp32.token_kv_bytes
    out = greedy_decode(runtime, 7)
    assert runtime.batches["b"].kv.prefix_k[0].dtype == torch.bfloat16
    for g, prompt in PROMPTS.items():
        # bf16 rounding may change a late argmax of a random model: the first tokens must agree with HF fp32
        assert out[10 * g][:4] == greedy(checkpoints["llama"], prompt, 4, None)


@pytest.fixture(scope="module")
def triton_available() -> None:
    pytest.importorskip("triton")


@pytest.mark.usefixtures("triton_available")
def test_triton_backend_verifies_like_torch_and_hf(checkpoints) -> None:
    """The Triton bifurcated kernels (the CUDA default) in a real model's verify: same logits as the torch
    backend over ragged windows, and plain decoding equal to HF generate."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_checkpoint(checkpoints["qwen2"], device=device)
    triton_rt = TargetRuntime(model, attention_backend="triton", cuda_graphs=False)
    assert triton_rt._bifurcated.__name__ == "bifurcated_attention_triton"
    torch_rt = TargetRuntime(model, attention_backend="torch")
    for runtime in (triton_rt, torch_rt):
        runtime.prefill("a", groups())
    tokens, widths = pad_windows([[3, 4, 5, 6], [6], [7, 8], [9, 10, 11]])
    logits = [rt.forward(tokens, widths, rt.batches["a"].decoded(), rt.batches["a"].kv, last_only=False)
              for rt in (triton_rt, torch_rt)]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
    out = greedy_decode(triton_rt, 6)
    for g, prompt in PROMPTS.items():
        assert out[10 * g] == greedy(checkpoints["qwen2"], prompt, 7, None)
        assert all(out[10 * g + i] == out[10 * g] for i in range(len(groups()[g].sequence_ids)))


@pytest.mark.usefixtures("triton_available")
def test_triton_backend_proposes_like_torch(checkpoints) -> None:
    model = load_checkpoint(checkpoints["llama_draft"], device="cuda" if torch.cuda.is_available() else "cpu")
    proposals = []
    for backend in ("triton", "torch"):
        runtime = DraftRuntime(model, attention_backend=backend, confidence_floor=0.0)
        runtime.prefill("a", groups())
        for sequence in runtime.batches["a"].sequences:
            sequence.pending = [sequence.sequence_id + 3]
        updates = {s.sequence_id: (0, 50 + s.sequence_id, ()) for s in runtime.batches["a"].sequences}
        proposals.append([p.token_ids for p in runtime.propose("a", updates, 3)])
    assert proposals[0] == proposals[1] and all(len(p) == 3 for p in proposals[0])


def load_tool(name: str):
    """A module of tools/ (not a package) loaded by path."""
    path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_device_check_summary_reads_the_benchmarks(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The summary of tools/device_check.sh, fed by real (tiny, CPU) runs of the benchmarks it calls."""
    tiny = {"attention_decode": ["attention", "--samples", "2", "--context", "16", "--heads", "2", "--head-dim", "8"],
            "decode": ["decode", "--samples", "2", "--context", "16", "--hidden", "32", "--layers", "1",
                       "--heads", "2", "--vocab", "50"]}
    for name, argv in tiny.items():
        assert main(["bench", *argv, "--device", "cpu", "--backend", "torch", "--repeats", "1", "--json"]) == 0
        (tmp_path / f"{name}.log").write_text("a warning line\n" + capsys.readouterr().out)
    (tmp_path / "steps.tsv").write_text("tests\t0\t5\nattention_decode\t0\t1\ndecode\t0\t1\ne2e\t124\t100\n")
    summary = load_tool("device_summary").summarise(tmp_path, 107)
    assert summary["steps"]["e2e"] == {"rc": 124, "seconds": 100}
    attention, decode = summary["measured"]["attention_decode"], summary["measured"]["decode_step"]
    assert attention["goal"] == 10.0 and attention["baseline"] == "sdpa-masked"
    assert decode["goal_met"] == (decode["ratio_standard_over_bifurcated"] >= 4.0)
    assert json.loads((tmp_path / "decode.json").read_text())["benchmark"] == "decode"


@no_cuda
def test_device_check_stops_at_once_without_cuda(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(["bash", str(root / "tools" / "device_check.sh")], capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path)), timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "sees no CUDA device" in (tmp_path / "environment.log").read_text()


def test_serve_with_explicit_cpu_device_and_bfloat16(deployments, checkpoints) -> None:
    """``serve draft|target --device cpu --dtype bfloat16`` through the coordinator."""
    deployment = deployments("llama", "llama_draft", model_args=("--device", "cpu", "--dtype", "bfloat16"))
    response = coordinator_stub(deployment.coordinator_address).Generate(coordinator_pb2.GenerateRequest(
        prompt_token_ids=PROMPTS[0], n=3, max_new_tokens=12, ignore_eos=True), timeout=120)
    completions = [list(c.token_ids) for c in response.completions]
    assert len(completions) == 3 and all(len(c) == 12 and c == completions[0] for c in completions)
    assert completions[0][:4] == greedy(checkpoints["llama"], PROMPTS[0], 4, None)


def test_auto_dtype_is_the_saved_dtype_where_the_device_runs_it(checkpoints, tmp_path) -> None:
    """--dtype auto: a float32 checkpoint loads in float32; a bfloat16 one in bfloat16 on CUDA and on a CPU
    with native bf16, float32 elsewhere; unknown names are refused."""
    assert load_checkpoint(checkpoints["llama"], "auto").model.dtype == torch.float32
    assert resolve_dtype("auto", torch.bfloat16, "cuda") == "bfloat16"
    assert resolve_dtype("auto", "float16", "cpu") == "float32"  # no native float16 matrix units assumed
    assert resolve_dtype("auto", None, "cpu") == "float32"
    assert resolve_dtype("bfloat16", torch.float32, "cpu") == "bfloat16"  # an explicit choice stands
    with pytest.raises(CheckpointError, match="unknown dtype"):
        resolve_dtype("int8", None, "cpu")
    saved = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.bfloat16).save_pretrained(saved)
    expected = torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    assert load_checkpoint(saved, "auto").model.dtype == expected
