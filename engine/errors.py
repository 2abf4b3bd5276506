"""Errors of the model runtime; the gRPC layer maps each to a status code."""


class InvalidInput(ValueError):
    """A request the runtime cannot run (bad ids, lengths, unknown sequences): INVALID_ARGUMENT."""


class UnknownBatch(LookupError):
    """The batch id is not held (never created, released or expired): NOT_FOUND."""


class ModelLoading(RuntimeError):
    """The service is up but its model has not finished loading: UNAVAILABLE (retry shortly)."""


class KVBudgetExceeded(RuntimeError):
    """Admitting the request would exceed the service's KV-cache memory budget: RESOURCE_EXHAUSTED."""
