"""specserve.v1.TargetModel over a TargetRuntime."""

from __future__ import annotations

import grpc

from engine.target import TargetRuntime
from serving import telemetry
from serving.grpc_server import grpc_errors
from serving.model_service import ModelServicer, distribution_from_proto
from specserve.v1 import model_pb2, model_pb2_grpc

SERVICE_NAME = "specserve.v1.TargetModel"


class TargetServicer(ModelServicer, model_pb2_grpc.TargetModelServicer):
    """Verify on top of the shared Info/Prefill/Release."""

    @grpc_errors
    def Verify(self, request: model_pb2.VerifyRequest, context: grpc.ServicerContext  # noqa: N802
               ) -> model_pb2.VerifyResponse:
        """Verify every live sequence's proposal in one forward pass (see ``TargetRuntime.verify``): greedy
        exact, sampled lossless; INVALID_ARGUMENT for bad proposals, NOT_FOUND for an unknown batch."""
        runtime: TargetRuntime = self._ready(context)
        proposals = {
            p.sequence_id: (list(p.token_ids), [distribution_from_proto(d) for d in p.distributions])
            for p in request.proposals
        }
        attributes = {**self.model_attributes, "specserve.batch_id": request.batch_id,
                      "specserve.sequences": len(request.proposals),
                      "specserve.draft_len": max((len(p.token_ids) for p in request.proposals), default=0),
                      "specserve.tokens_proposed": sum(len(p.token_ids) for p in request.proposals)}
        with telemetry.server_span("target.verify", context, attributes) as span, \
                self.metrics.forward.labels("verify").time():
            verdicts = self.compute.call(runtime.verify, request.batch_id, proposals,
                                              list(request.release_sequence_ids))
            kv_bytes = runtime.kv_bytes_in_use()
            span.set_attributes({"specserve.tokens_accepted": sum(v.accepted_len for v in verdicts),
                                 "specserve.kv_bytes": kv_bytes})
        return model_pb2.VerifyResponse(
            verdicts=[model_pb2.Verdict(sequence_id=v.sequence_id, accepted_len=v.accepted_len,
                                        next_token_id=v.next_token_id, logprobs=v.logprobs) for v in verdicts],
            kv_bytes=kv_bytes,
        )


def add_to_server(servicer: TargetServicer, server: grpc.Server) -> None:
    """Register the TargetModel service."""
    model_pb2_grpc.add_TargetModelServicer_to_server(servicer, server)
