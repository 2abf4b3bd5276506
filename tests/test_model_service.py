"""A model service that is still loading its model: NOT_SERVING health and UNAVAILABLE calls."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draft_service.servicer import SERVICE_NAME, DraftServicer, add_to_server
from serving.grpc_server import create_server, set_serving
from serving.tls import TLSFiles
from specserve.v1 import model_pb2, model_pb2_grpc


def test_loading_service_reports_not_serving_and_unavailable():
    servicer = DraftServicer()
    server, health_servicer, port = create_server([SERVICE_NAME], "127.0.0.1", 0, TLSFiles())
    add_to_server(servicer, server)
    server.start()
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as raised:
            model_pb2_grpc.DraftModelStub(channel).Info(model_pb2.InfoRequest(), timeout=10)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "still loading" in raised.value.details()
        set_serving(health_servicer, [SERVICE_NAME], True)
        reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0)
