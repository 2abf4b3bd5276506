"""What every specserve gRPC server process shares: the server and its error mapping (``grpc_server``), TLS
(``tls``), Prometheus metrics (``metrics``), OpenTelemetry tracing (``telemetry``) and the model-service base
the draft and target services are built on (``model_service``)."""
