"""The draft-model gRPC service: proposes k tokens per sequence each round."""
