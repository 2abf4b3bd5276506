"""The target-model gRPC service: verifies draft proposals in one batched pass (bifurcated attention)."""
