"""specserve.v1.DraftModel over a DraftRuntime."""

from __future__ import annotations

import grpc

from engine.draft import DraftRuntime
from serving import telemetry
from serving.grpc_server import grpc_errors
from serving.model_service import ModelServicer, distribution_to_proto
from specserve.v1 import model_pb2, model_pb2_grpc

SERVICE_NAME = "specserve.v1.DraftModel"


class DraftServicer(ModelServicer, model_pb2_grpc.DraftModelServicer):
    """Propose on top of the shared Info/Prefill/Release."""

    @grpc_errors
    def Propose(self, request: model_pb2.ProposeRequest, context: grpc.ServicerContext  # noqa: N802
                ) -> model_pb2.ProposeResponse:
        """Apply last round's verdicts and propose up to ``draft_len`` tokens per live sequence (see
        ``DraftRuntime.propose``); INVALID_ARGUMENT for bad updates, NOT_FOUND for an unknown batch."""
        runtime: DraftRuntime = self._ready(context)
        updates = {u.sequence_id: (u.accepted_len, u.next_token_id, list(u.catch_up_token_ids))
                   for u in request.updates}
        attributes = {**self.model_attributes, "specserve.batch_id": request.batch_id,
                      "specserve.sequences": len(request.updates), "specserve.draft_len": request.draft_len}
        with telemetry.server_span("draft.propose", context, attributes) as span, \
                self.metrics.forward.labels("propose").time():
            proposals = self.compute.call(runtime.propose, request.batch_id, updates, request.draft_len,
                                               list(request.release_sequence_ids))
            kv_bytes = runtime.kv_bytes_in_use()
            span.set_attributes({"specserve.tokens_proposed": sum(len(p.token_ids) for p in proposals),
                                 "specserve.prompt_lookup_tokens": sum(p.lookup_tokens for p in proposals),
                                 # sequences whose proposal the confidence floor stopped short of draft_len
                                 "specserve.proposals_cut_short": sum(len(p.token_ids) < request.draft_len
                                                                      for p in proposals),
                                 "specserve.kv_bytes": kv_bytes})
        return model_pb2.ProposeResponse(
            proposals=[
                model_pb2.Proposal(
                    sequence_id=p.sequence_id, token_ids=p.token_ids,
                    distributions=[distribution_to_proto(d) for d in p.distributions],
                )
                for p in proposals
            ],
            kv_bytes=kv_bytes,
        )


def add_to_server(servicer: DraftServicer, server: grpc.Server) -> None:
    """Register the DraftModel service."""
    model_pb2_grpc.add_DraftModelServicer_to_server(servicer, server)
