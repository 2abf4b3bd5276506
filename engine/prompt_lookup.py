"""Prompt-lookup proposals: continue a sequence the way it continued the last time its tail occurred.

Code generation copies a lot (identifiers, argument lists, repeated lines, closing brackets), so the last
few tokens of a sequence often occurred before in its prompt or its own output, followed by what comes
next (prompt lookup decoding, Saxena 2023; vLLM's and TGI's n-gram speculators). The draft service uses
such a continuation as the first tokens of its proposal and lets the draft model propose the rest; the
target verifies them like any other draft tokens.

``PromptNgrams`` indexes a group's prompt once (shared by its n samples); each sample's ``PromptLookup``
indexes what it generated on top. Both map an n-gram to the position right after its latest occurrence
that is followed by at least one known token, so a lookup is a dict probe per n, however long the context.

A good draft model beats lookup, a weak one loses to it, and which holds depends on the request, so each
group (the n samples of one request) keeps score in a ``LookupScore``: whenever the lookup's first token
and the model's first token of a proposal differ, the token the target then confirmed at that position
counts for whichever was right, and lookup leads a proposal only once it has been right more often than
the model (the model goes first: a good draft loses nothing). Both candidates see the same confirmed
context, so the comparison is fair whichever one was proposed. The choice depends only on earlier
rounds, so the target's rejection sampling stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Ngram = tuple[int, ...]
DEFAULT_NGRAM_SIZES = (2, 3)  # (min n, max n): single tokens match too often to predict, longer tails seldom recur


def check_ngram_sizes(min_n: int, max_n: int) -> None:
    """Raise ValueError unless 1 <= ``min_n`` <= ``max_n``: the n-gram sizes prompt lookup can use."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"prompt lookup needs 1 <= min_n ({min_n}) <= max_n ({max_n})")


def _index(tokens: Sequence[int], offset: int, ends: range, sizes: range, into: dict[Ngram, int]) -> None:
    """For every end position in ``ends`` and n in ``sizes``, map the n tokens before ``end`` to ``end`` (later
    ends win). ``tokens[i]`` is the context's token ``offset + i``; it must reach back ``max(sizes)`` before ends."""
    for end in ends:
        for n in sizes:
            if end - n >= offset:
                into[tuple(tokens[end - n - offset:end - offset])] = end


class PromptNgrams:
    """The n-grams (``min_n`` <= n <= ``max_n``) of one prompt, each mapped to the latest position after it."""

    def __init__(self, prompt: Sequence[int], min_n: int, max_n: int) -> None:
        check_ngram_sizes(min_n, max_n)
        self.prompt = list(prompt)
        self.sizes = range(min_n, max_n + 1)
        self.latest: dict[Ngram, int] = {}
        _index(self.prompt, 0, range(len(self.prompt)), self.sizes, self.latest)


# Prior of a lookup token's chance of acceptance: 3 of 4, as measured on held-out code (greedy, models/README.md).
LOOKUP_PRIOR_ACCEPTED, LOOKUP_PRIOR_TRIED = 3, 4


@dataclass
class LookupScore:
    """How often lookup and the draft model were right where their first tokens disagreed, and how often a
    lookup token matched the target's confirmed token where its predecessors did (one per group; whether the
    lookup tokens were proposed or not, so the estimate does not starve while lookup is not proposed)."""

    lookup_right: int = 0
    model_right: int = 0
    lookup_accepted: int = 0
    lookup_tried: int = 0

    @property
    def lookup_confidence(self) -> float:
        """The estimated chance that the target confirms a lookup token whose predecessors it confirmed (for a
        proposed token: accepts it): the group's rate so far, smoothed towards the measured prior."""
        return (self.lookup_accepted + LOOKUP_PRIOR_ACCEPTED) / (self.lookup_tried + LOOKUP_PRIOR_TRIED)


class PromptLookup:
    """One sequence's context (its group's prompt, then the tokens it has confirmed), its proposals, and its
    share in the group's score of lookup against the draft model."""

    def __init__(self, prompt: PromptNgrams, score: LookupScore) -> None:
        self.prompt = prompt
        self.score = score
        self.generated: list[int] = []
        self.latest: dict[Ngram, int] = {}  # n-grams ending in the generated part (beyond the prompt's)
        self._disputed: tuple[int, int] | None = None  # (lookup's, model's) first token of the last proposal
        self._found: list[int] = []  # the lookup continuation at the last proposal, proposed or not

    def __len__(self) -> int:
        return len(self.prompt.prompt) + len(self.generated)

    def _tokens(self, start: int, stop: int) -> list[int]:
        """Context tokens ``[start, stop)`` across the prompt/generated boundary."""
        prompt = self.prompt.prompt
        head = prompt[start:stop] if start < len(prompt) else []
        return head + self.generated[max(start - len(prompt), 0):max(stop - len(prompt), 0)]

    def choose(self, found: list[int], model_first: int) -> list[int]:
        """The lookup tokens ``found`` to lead this proposal when lookup has been right more often than the model,
        else [] (the model proposes it all); notes a disagreement of the two first tokens for ``settle``."""
        self._disputed = (found[0], model_first) if found and found[0] != model_first else None
        self._found = found
        return found if self.score.lookup_right > self.score.model_right else []

    def confident(self, count: int, floor: float) -> list[int]:
        """A proposal of lookup tokens alone (no draft model): the first of up to ``count`` continuation tokens
        while the estimated chance that the target accepts them all (the group's ``lookup_confidence`` to the
        power of their number) stays at or above ``floor``. The whole continuation is scored at the next
        ``settle``, proposed or not, so a request whose lookup earns trust gets proposals again."""
        found = self.propose(count)
        self._disputed, self._found = None, found
        confidence, chance, length = self.score.lookup_confidence, 1.0, 0
        while length < len(found) and chance * confidence >= floor:
            chance *= confidence
            length += 1
        return found[:length]

    def settle(self, confirmed: Sequence[int] | None) -> None:
        """Score the last proposal against the tokens the target confirmed from its first position on (None:
        unknown, e.g. the sequence missed rounds): the disagreement of its first tokens, and the lookup
        continuation up to its first token that differs from a confirmed one."""
        if confirmed:
            if self._disputed is not None:
                self.score.lookup_right += self._disputed[0] == confirmed[0]
                self.score.model_right += self._disputed[1] == confirmed[0]
            for token, right in zip(self._found, confirmed, strict=False):
                self.score.lookup_tried += 1
                if token != right:
                    break
                self.score.lookup_accepted += 1
        self._disputed, self._found = None, []

    def advance(self, confirmed: Sequence[int]) -> None:
        """The round's outcome: score the last proposal against the ``confirmed`` tokens, which continue the
        context from its first position (``settle``), then append them (``extend``)."""
        self.settle(confirmed)
        self.extend(confirmed)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append confirmed tokens (accepted by the target) to the context."""
        before = len(self)
        self.generated.extend(tokens)
        first = max(before, len(self.prompt.prompt))  # n-grams ending earlier are indexed already
        offset = max(first - self.prompt.sizes[-1], 0)
        # an n-gram ending at `end` is followed by the known token `end`
        _index(self._tokens(offset, len(self)), offset, range(first, len(self)), self.prompt.sizes, self.latest)

    def propose(self, count: int) -> list[int]:
        """Up to ``count`` tokens that followed the latest earlier occurrence of the context's last n tokens,
        trying the longest n first; [] when no tail of ``min_n`` or more tokens occurred before."""
        length = len(self)
        if count <= 0:
            return []
        for n in reversed(self.prompt.sizes):
            if n > length:
                continue
            tail = tuple(self._tokens(length - n, length))
            after = self.latest.get(tail, self.prompt.latest.get(tail))
            if after is not None:
                return self._tokens(after, min(after + count, length))
        return []
