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
    _text: str | None = None  # the final text, cut at a stop string
    _emitted: str = ""
    _decoded: str = ""  # text of token_ids[:_read], decoded a window at a time (``_decode_new``)
    _prefix: int = 0  # where the window decoding the next tokens starts (context for the decoder)
    _read: int = 0  # tokens whose text is in _decoded
    _searched: int = 0  # characters of _decoded already searched for stop strings

    @property
    def finished(self) -> bool:
        """True once a stopping rule fired (or the request was cancelled)."""
        return bool(self.finish_reason)

    @property
    def text(self) -> str:
        """The completion text (without the stop string that ended it): the tokenizer's decoding of all its
        tokens."""
        return self._text if self._text is not None else self.codec.decode(self.token_ids)

    def _decode_new(self) -> str:
        """The text of the tokens so far, short of a multi-byte character still incomplete at its end, decoding
        only the newest tokens: each call decodes the window since the text it last settled and takes what the
        new tokens add (as TGI's and vLLM's detokenizers do), settling it once it does not end inside a
        character. Costs O(window) a call, not O(length)."""
        if self._read == len(self.token_ids):
            return self._decoded
        settled = self.codec.decode(self.token_ids[self._prefix:self._read])
        added = self.codec.decode(self.token_ids[self._prefix:])[len(settled):]
        if not added or added.endswith(REPLACEMENT_CHAR):
            return self._decoded + added.rstrip(REPLACEMENT_CHAR)
        self._decoded += added
        self._prefix, self._read = self._read, len(self.token_ids)
        return self._decoded

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
        text = self._decode_new()
        start = max(0, self._searched - max(len(s) for s in self.stop) + 1)  # a stop may straddle the old end
        self._searched = len(text)
        if not any(text.find(s, start) >= 0 for s in self.stop):
            return False
        text = self.codec.decode(self.token_ids)  # the final text: cut where the whole decoding has the stop
        cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if cuts:
            self._text = text[: min(cuts)]
        return bool(cuts)

    def take_text(self) -> str:
        """Text not handed out yet (for streaming): held back while it may still be cut by a stop
        string or ends inside a multi-byte character; everything once the sample finished."""
        text = self.text if self.finished else self._decode_new()
        if not self.finished:
            # Hold back an incomplete UTF-8 sequence and anything that may still become a stop string.
            text = text.rstrip(REPLACEMENT_CHAR)
            hold = max((len(s) - 1 for s in self.stop), default=0)
            text = text[: max(len(self._emitted), len(text) - hold)]
        if not text.startswith(self._emitted):
            return ""
        delta, self._emitted = text[len(self._emitted):], text
        return delta
