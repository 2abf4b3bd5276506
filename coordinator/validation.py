"""Range checks of the public GenerateRequest; every failure names the field."""

from __future__ import annotations

import math
from dataclasses import dataclass

from coordinator.text import TextCodec
from engine.sampling import SamplingParams
from specserve.v1 import coordinator_pb2

DEFAULT_MAX_NEW_TOKENS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


class InvalidRequest(ValueError):
    """A request field out of range; the message starts with the field name."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Limits:
    """What the deployment accepts: model context and vocabulary, and the coordinator's own caps."""

    vocab_size: int
    max_context: int
    max_n: int


@dataclass(frozen=True)
class GenerationSpec:
    """A validated request: token ids, n, lengths, sampling, stopping."""

    prompt_token_ids: list[int]
    n: int
    max_new_tokens: int
    sampling: SamplingParams
    stop: list[str]
    ignore_eos: bool
    logprobs: bool = False


def validate_request(request: coordinator_pb2.GenerateRequest, limits: Limits, codec: TextCodec) -> GenerationSpec:
    """A GenerationSpec for a well-formed request; raises InvalidRequest naming the first bad field."""
    n = request.n if request.HasField("n") else 1
    if not 1 <= n <= limits.max_n:
        raise InvalidRequest("n", f"must be between 1 and {limits.max_n} (the server's --max-n), got {n}")
    max_new = request.max_new_tokens if request.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS
    if max_new <= 0:
        raise InvalidRequest("max_new_tokens", f"must be positive, got {max_new}")
    if not math.isfinite(request.temperature) or request.temperature < 0:
        raise InvalidRequest("temperature", f"must be a finite number >= 0 (0 = greedy), got {request.temperature}")
    top_p = request.top_p if request.HasField("top_p") else 1.0
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise InvalidRequest("top_p", f"must be in (0, 1], got {top_p}")
    if request.top_k < 0:
        raise InvalidRequest("top_k", f"must be >= 0 (0 disables it), got {request.top_k}")
    if len(request.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(request.stop)}")
    for stop in request.stop:
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise InvalidRequest("stop", f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
    if request.stop and not codec.available:
        raise InvalidRequest("stop", "the model has no tokenizer, so its output has no text to stop on")
    if request.prompt_token_ids:
        prompt = list(request.prompt_token_ids)
        bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
        if bad:
            raise InvalidRequest("prompt_token_ids",
                                 f"ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})")
    elif request.prompt:
        if not codec.available:
            raise InvalidRequest("prompt", "the model has no tokenizer; send prompt_token_ids")
        if len(request.prompt) > codec.max_chars(limits.max_context):
            raise InvalidRequest("prompt", f"{len(request.prompt)} characters cannot fit the model context of "
                                           f"{limits.max_context} tokens; shorten it")
        prompt = codec.encode(request.prompt)
        if not prompt:
            raise InvalidRequest("prompt", "tokenizes to no tokens")
    else:
        raise InvalidRequest("prompt", "empty: set prompt or prompt_token_ids")
    if len(prompt) >= limits.max_context:
        raise InvalidRequest("prompt", f"{len(prompt)} tokens leave no room for output in the model context of "
                                       f"{limits.max_context} tokens; shorten it")
    if len(prompt) + max_new > limits.max_context:
        raise InvalidRequest(
            "max_new_tokens",
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new}) exceeds the model context "
            f"of {limits.max_context} tokens",
        )
    sampling = SamplingParams(temperature=float(request.temperature), top_p=float(top_p), top_k=request.top_k,
                              seed=request.seed)
    return GenerationSpec(prompt_token_ids=prompt, n=n, max_new_tokens=max_new, sampling=sampling,
                          stop=list(request.stop), ignore_eos=request.ignore_eos, logprobs=request.logprobs)
