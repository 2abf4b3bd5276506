"""TLS and mutual TLS on every hop, and the bearer token on the public API."""

from __future__ import annotations

import grpc
import pytest
from certs import make_certificates
from conftest import coordinator_stub
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tiny_models import FIXED_K

from deployment.processes import Deployment
from serving.grpc_server import open_channel
from serving.tls import TLSFiles
from specserve.v1 import coordinator_pb2, coordinator_pb2_grpc

REQUEST = coordinator_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], n=2, max_new_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("mode", ["tls", "mtls"])
def test_tls_round_trip_on_every_hop(checkpoints, tmp_path, mode):
    tls_only, mutual = make_certificates(tmp_path)
    with Deployment(str(checkpoints["llama"]), str(checkpoints["llama_draft"]),
                    tls=mutual if mode == "mtls" else tls_only, log_dir=tmp_path, draft_args=FIXED_K) as deployment:
        trusted = TLSFiles(ca=mutual.ca, cert=mutual.cert, key=mutual.key) if mode == "mtls" else TLSFiles(ca=mutual.ca)
        stub = coordinator_pb2_grpc.CoordinatorStub(open_channel(deployment.coordinator_address, trusted))
        response = stub.Generate(REQUEST, timeout=120)
        assert [len(c.token_ids) for c in response.completions] == [8, 8]
        assert response.usage.draft_tokens_proposed > 0  # the coordinator reached the draft over TLS too
        # Plaintext clients are refused; under mTLS so are clients without a certificate.
        with pytest.raises(grpc.RpcError):
            coordinator_stub(deployment.coordinator_address).Generate(REQUEST, timeout=10)
        if mode == "mtls":
            anonymous = coordinator_pb2_grpc.CoordinatorStub(open_channel(deployment.coordinator_address,
                                                                          TLSFiles(ca=mutual.ca)))
            with pytest.raises(grpc.RpcError) as raised:
                anonymous.Generate(REQUEST, timeout=10)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


def test_bearer_token(checkpoints, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    with Deployment(str(checkpoints["llama"]), None, coordinator_args=["--auth-token-file", str(token_file)],
                    log_dir=tmp_path) as deployment:
        channel = grpc.insecure_channel(deployment.coordinator_address)
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "s3cret-token"),)):
            with pytest.raises(grpc.RpcError) as raised:
                stub.Generate(REQUEST, metadata=metadata, timeout=30)
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "bearer token" in raised.value.details()
            with pytest.raises(grpc.RpcError) as raised:
                list(stub.GenerateStream(REQUEST, metadata=metadata, timeout=30))
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = (("authorization", "Bearer s3cret-token"),)
        assert len(stub.Generate(REQUEST, metadata=good, timeout=60).completions) == 2
        assert list(stub.GenerateStream(REQUEST, metadata=good, timeout=60))[-1].usage.completion_tokens == 16
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token
