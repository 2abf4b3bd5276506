"""Tokenization on the coordinator, from the target model's tokenizer.json."""

from __future__ import annotations

from tokenizers import Tokenizer


class TextCodec:
    """Encodes prompts and decodes completions with the target's tokenizer (None: token ids only)."""

    def __init__(self, tokenizer_json: str) -> None:
        self._tokenizer = Tokenizer.from_str(tokenizer_json) if tokenizer_json else None
        vocab = self._tokenizer.get_vocab(with_added_tokens=True) if self._tokenizer is not None else {}
        self._longest = max(map(len, vocab), default=1)

    def max_chars(self, tokens: int) -> int:
        """A text longer than this cannot encode to ``tokens`` tokens or fewer: no token covers more characters
        than the longest vocabulary entry (bytes, for byte-level tokenizers), doubled for normalizers that drop
        characters."""
        return 2 * tokens * self._longest

    @property
    def available(self) -> bool:
        """True when the model shipped a tokenizer, so text prompts and text output work."""
        return self._tokenizer is not None

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt, exactly as the HF fast tokenizer of the model encodes it."""
        if self._tokenizer is None:
            raise ValueError("the target model has no tokenizer: send prompt_token_ids instead of prompt")
        return self._tokenizer.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        """Text of token ids without special tokens ('' when there is no tokenizer)."""
        if self._tokenizer is None:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)
