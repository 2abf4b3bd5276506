"""Linear layers on oneDNN-packed weights (engine.cpu_linear): the same products as nn.Linear, the same
state dict, and the switch that turns them off. The engine's outputs on packed models are checked against
HF's own modules by the HF-oracle tests (test_kv_layouts, test_e2e_greedy, test_default_pair, ...)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.checkpoint import load_checkpoint
from engine.cpu_linear import ENV_SWITCH, PackedLinear, onednn_linear_available, pack_linears

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="this PyTorch has no oneDNN linear")


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_computes_what_nn_linear_does(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160, bias=bias)
    packed = PackedLinear(linear)
    inputs = [torch.randn(8, 96), torch.randn(3, 5, 96), torch.randn(96, 7).t(), torch.randn(0, 96)]
    with torch.inference_mode():
        for x in inputs:
            out = packed(x)
            assert out.shape == (*x.shape[:-1], 160) and out.layout == torch.strided
            torch.testing.assert_close(out, linear(x), atol=2e-5, rtol=1e-5)
    state = packed.state_dict()
    assert state.keys() == linear.state_dict().keys()
    for key, value in linear.state_dict().items():
        assert torch.equal(state[key], value), key


def test_pack_linears_replaces_every_float32_projection_and_keeps_the_logits(checkpoints):
    stock = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.float32).eval()
    layers = model.config.num_hidden_layers
    assert pack_linears(model) == 7 * layers + 1  # q, k, v, o, gate, up, down per layer, and the LM head
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert model.state_dict().keys() == stock.state_dict().keys()
    ids = torch.tensor([[5, 17, 200, 31, 9, 44, 120, 7]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, stock(ids).logits, atol=1e-4, rtol=1e-4)


def test_bfloat16_models_and_the_switch_leave_nn_linear(checkpoints, monkeypatch):
    bf16 = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.bfloat16)
    assert pack_linears(bf16) == 0
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert not onednn_linear_available()
    stock = load_checkpoint(checkpoints["llama"]).model
    assert isinstance(stock.lm_head, torch.nn.Linear) and isinstance(stock.model.layers[0].mlp.up_proj, torch.nn.Linear)


def test_load_checkpoint_packs_unless_asked_not_to(checkpoints):
    assert isinstance(load_checkpoint(checkpoints["llama"]).model.lm_head, PackedLinear)
    assert isinstance(load_checkpoint(checkpoints["llama"], packed_linears=False).model.lm_head, torch.nn.Linear)
