"""One sample's output as it grows: stopping rules (EOS, stop strings, length) and streamed text."""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.text import TextCodec

REPLACEMENT_CHAR = "\ufffd"


@dataclass
class Delta:
    """What a round added to a sample: new token ids (and their logprobs, when asked for), and the finish
    reason once finished."""

    token_ids: list[int]
    finish_reason: str
    logprobs: list[float] = field(default_factory=list)


@dataclass
class SampleOutput:
    """Accepted tokens of one sample, cut exactly where its first stopping rule fires."""

    index: int
    sequence_id: int
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    stop: list[str]
    codec: TextCodec
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # one per token id, when the request asked for them
    finish_reason: str = ""
    _text: str | None = None
    _emitted: str = ""

    @property
    def finished(self) -> bool:
        """True once a stopping rule fired (or the request was cancelled)."""
        return bool(self.finish_reason)

    @property
    def text(self) -> str:
        """The completion text (without the stop string that ended it)."""
        return self._text if self._text is not None else self.codec.decode(self.token_ids)

    def finish(self, reason: str) -> None:
        """Stop the sample with this reason (no-op when it already finished)."""
        if not self.finish_reason:
            self.finish_reason = reason

    def extend(self, tokens: list[int], logprobs: list[float] | None = None) -> Delta:
        """Append tokens the target accepted (with their ``logprobs``, one per token, when given), up to the
        first stopping rule; return what is new. Raises ValueError when ``logprobs`` does not match ``tokens``."""
        if logprobs is not None and len(logprobs) != len(tokens):
            raise ValueError(f"{len(logprobs)} logprobs for {len(tokens)} tokens")
        start = len(self.token_ids)
        for position, token in enumerate(tokens):
            if self.finished:
                break
            self.token_ids.append(token)
            if logprobs is not None:
                self.logprobs.append(logprobs[position])
            if token in self.eos_token_ids:
                self.finish("eos")
            elif self.stop and self._hit_stop():
                self.finish("stop")
            elif len(self.token_ids) >= self.max_new_tokens:
                self.finish("length")
        return Delta(self.token_ids[start:], self.finish_reason, self.logprobs[start:])

    def _hit_stop(self) -> bool:
        text = self.codec.decode(self.token_ids)
        cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if cuts:
            self._text = text[: min(cuts)]
        return bool(cuts)

    def take_text(self) -> str:
        """Text not handed out yet (for streaming): held back while it may still be cut by a stop
        string or ends inside a multi-byte character; everything once the sample finished."""
        text = self.text
        if not self.finished:
            # Hold back an incomplete UTF-8 sequence and anything that may still become a stop string.
            text = text.rstrip(REPLACEMENT_CHAR)
            hold = max((len(s) - 1 for s in self.stop), default=0)
            text = text[: max(len(self._emitted), len(text) - hold)]
        if not text.startswith(self._emitted):
            return ""
        delta, self._emitted = text[len(self._emitted):], text
        return delta
