"""Bad requests get INVALID_ARGUMENT naming the field, and the server keeps serving."""

from __future__ import annotations

import shutil
import subprocess
import sys

import grpc
import pytest
from conftest import coordinator_stub
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from deployment.processes import Deployment, free_port
from specserve.v1 import coordinator_pb2

R = coordinator_pb2.GenerateRequest

BAD = [
    pytest.param(R(prompt_token_ids=[5], n=0), "n", id="n-zero"),
    pytest.param(R(prompt_token_ids=[5], n=-3), "n", id="n-negative"),
    pytest.param(R(prompt_token_ids=[5], n=1000), "n", id="n-beyond-max-n"),
    pytest.param(R(prompt_token_ids=[5], max_new_tokens=0), "max_new_tokens", id="max-new-zero"),
    pytest.param(R(prompt_token_ids=[5], max_new_tokens=-1), "max_new_tokens", id="max-new-negative"),
    pytest.param(R(), "prompt", id="empty-prompt"),
    pytest.param(R(prompt_token_ids=[5, 10_000]), "prompt_token_ids", id="id-beyond-vocab"),
    pytest.param(R(prompt_token_ids=[-1]), "prompt_token_ids", id="negative-id"),
    pytest.param(R(prompt_token_ids=[5] * 500, max_new_tokens=64), "max_new_tokens", id="beyond-context"),
    pytest.param(R(prompt_token_ids=[5] * 512, max_new_tokens=1), "prompt", id="prompt-fills-the-context"),
    # refused before tokenizing (seconds of the coordinator's time): no 512 tokens cover 2M characters
    pytest.param(R(prompt="x = 1\n" * 400_000), "prompt", id="text-prompt-beyond-context"),
    pytest.param(R(prompt_token_ids=[5], temperature=-1.0), "temperature", id="temperature-negative"),
    pytest.param(R(prompt_token_ids=[5], temperature=float("nan")), "temperature", id="temperature-nan"),
    pytest.param(R(prompt_token_ids=[5], top_p=0.0), "top_p", id="top-p-zero"),
    pytest.param(R(prompt_token_ids=[5], top_p=1.5), "top_p", id="top-p-above-one"),
    pytest.param(R(prompt_token_ids=[5], top_p=float("nan")), "top_p", id="top-p-nan"),
    pytest.param(R(prompt_token_ids=[5], top_k=-1), "top_k", id="top-k-negative"),
    pytest.param(R(prompt_token_ids=[5], stop=["x"] * 17), "stop", id="too-many-stops"),
    pytest.param(R(prompt_token_ids=[5], stop=[""]), "stop", id="empty-stop"),
]


@pytest.mark.parametrize(("request_message", "field"), BAD)
def test_invalid_argument_names_field_and_server_keeps_serving(deployments, request_message, field):
    stub = coordinator_stub(deployments("llama", "llama_draft").coordinator_address)
    with pytest.raises(grpc.RpcError) as raised:
        stub.Generate(request_message, timeout=60)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith(f"{field}:")
    ok = stub.Generate(R(prompt_token_ids=[5, 6], n=2, max_new_tokens=3, ignore_eos=True), timeout=60)
    assert [len(c.token_ids) for c in ok.completions] == [3, 3]


def test_stop_strings_need_a_tokenizer(checkpoints, tmp_path):
    """A model shipped without a tokenizer has no output text: a stop string could never match, so the request is
    refused (it finished at max_new_tokens before), and token-id requests are still served."""
    model = tmp_path / "no-tokenizer"
    model.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(checkpoints["llama"] / name, model / name)
    with Deployment(str(model), None, log_dir=tmp_path) as deployment:
        stub = coordinator_stub(deployment.coordinator_address)
        with pytest.raises(grpc.RpcError) as raised:
            stub.Generate(R(prompt_token_ids=[5, 6], max_new_tokens=4, stop=["\n"]), timeout=60)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details().startswith("stop:") and "tokenizer" in raised.value.details()
        ok = stub.Generate(R(prompt_token_ids=[5, 6], max_new_tokens=3, ignore_eos=True), timeout=60)
        assert len(ok.completions[0].token_ids) == 3


def test_health_and_reflection_on_every_server(deployments):
    deployment = deployments("llama", "llama_draft")
    expected = {"draft": "specserve.v1.DraftModel", "target": "specserve.v1.TargetModel",
                "coordinator": "specserve.v1.Coordinator"}
    for role, service in expected.items():
        channel = grpc.insecure_channel(deployment.servers[role].address)
        for name in ("", service):
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for reply in replies for s in reply.list_services_response.service}
        assert {service, "grpc.health.v1.Health"} <= names


def test_coordinator_refuses_a_draft_with_another_tokenizer(checkpoints, tmp_path):
    from deployment.processes import ServerProcess

    servers = [ServerProcess("target", free_port(), ["--model", str(checkpoints["llama"])]),
               ServerProcess("draft", free_port(), ["--model", str(checkpoints["mismatched_draft"])])]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_serving()
        result = subprocess.run(
            [sys.executable, "-m", "specserve", "serve", "coordinator", "--port", str(free_port()),
             "--target", servers[0].address, "--draft", servers[1].address, "--connect-timeout", "30"],
            capture_output=True, text=True, timeout=120)
    finally:
        for server in servers:
            server.stop()
    assert result.returncode != 0
    assert "do not share a tokenizer" in result.stderr
