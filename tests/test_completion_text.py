"""A sample's text as it grows (``coordinator.completion.SampleOutput``), against the tokenizer's decoding of all
its tokens: streamed pieces add up to it, and a stop string cuts where the whole decoding first holds it."""

from __future__ import annotations

import random

import pytest
from tiny_models import train_tokenizer

from coordinator.completion import SampleOutput
from coordinator.text import TextCodec

TEXT = ("def grüße(naïve):\n    return '☃ 日本語 🎉' * 3  # café — ok\n" * 6
        + "\tfor x in range(10):\n        print(x, 'ünïcödé')\n" * 4)


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec(train_tokenizer().backend_tokenizer.to_str())


def feed(codec: TextCodec, tokens: list[int], rng: random.Random, stop: list[str]) -> tuple[SampleOutput, str]:
    """Extend a sample by ``tokens`` in random chunks (as rounds accept them), streaming its text after each."""
    sample = SampleOutput(index=0, sequence_id=1, max_new_tokens=len(tokens), eos_token_ids=frozenset(), stop=stop,
                          codec=codec)
    streamed, position = "", 0
    while position < len(tokens) and not sample.finished:
        step = rng.randint(1, 5)
        sample.extend(tokens[position:position + step])
        position += step
        streamed += sample.take_text()
    return sample, streamed


def test_streamed_pieces_add_up_to_the_whole_decoding(codec):
    tokens = codec.encode(TEXT)
    assert codec.decode(tokens) == TEXT
    for seed in range(20):
        rng = random.Random(seed)
        cut = tokens[: rng.randint(1, len(tokens))]
        sample, streamed = feed(codec, cut, rng, [])
        assert sample.finish_reason == "length"
        assert streamed == sample.text == codec.decode(cut)


def test_a_stop_string_cuts_where_the_whole_decoding_first_holds_it(codec):
    tokens = codec.encode(TEXT)
    rng = random.Random(0)
    for _ in range(60):
        start = rng.randrange(len(TEXT) - 8)
        stop = TEXT[start:start + rng.randint(1, 8)]
        first = next(k for k in range(1, len(tokens) + 1) if stop in codec.decode(tokens[:k]))
        sample, streamed = feed(codec, tokens, rng, [stop, "never seen"])
        assert sample.finish_reason == "stop", stop
        assert len(sample.token_ids) == first, stop
        assert sample.text == TEXT[: TEXT.find(stop)] == streamed, stop
