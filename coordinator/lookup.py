"""Speculation without a draft call: the coordinator's own prompt-lookup proposals for draft-free rounds.

A round that calls no draft (the speculation gate measured plain rounds faster for the batch, the draft is
down, or none is deployed) need not verify one token per sequence: the coordinator holds every sequence's
tokens, so it proposes the continuation of the latest earlier occurrence of each sequence's tail in its
prompt or its own output (``engine.prompt_lookup``; vLLM's and TGI's n-gram speculators work the same way)
and the target verifies those in the same single Verify. Such a proposal costs no model step and no second
RPC, only the verify's extra tokens, so on a CPU, where a verify is priced by its tokens, it is cut where the
request's measured lookup acceptance says the target is unlikely to take all of it (the draft's confidence
floor, ``engine.draft.DEFAULT_CONFIDENCE_FLOOR``). Sampled sequences send a point distribution with each
token, which keeps the target's rejection sampling exact; greedy output stays the target's.

Every round (draft rounds too) extends each sequence's context with what the target confirmed and scores
what lookup would have proposed, so its estimate is current when a draft-free round comes.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.draft import DEFAULT_CONFIDENCE_FLOOR
from engine.prompt_lookup import DEFAULT_NGRAM_SIZES, LookupScore, PromptLookup, PromptNgrams, check_ngram_sizes
from engine.sampling import point_distribution
from serving.model_service import distribution_to_proto
from specserve.v1 import model_pb2


class LookupProposer:
    """Prompt-lookup contexts of a batch's sequences (one n-gram index and one score per group) and their
    draft-free proposals."""

    def __init__(self, ngram_sizes: tuple[int, int] = DEFAULT_NGRAM_SIZES,
                 confidence_floor: float = DEFAULT_CONFIDENCE_FLOOR) -> None:
        """Lookup over n-grams of ``ngram_sizes`` (min n, max n); proposals stop before the chance of their full
        acceptance falls below ``confidence_floor``. Raises ValueError for bad sizes."""
        check_ngram_sizes(*ngram_sizes)
        self.ngram_sizes = ngram_sizes
        self.confidence_floor = confidence_floor
        self._contexts: dict[int, PromptLookup] = {}

    def start(self, prompt: Sequence[int], first_tokens: dict[int, int]) -> None:
        """Begin the contexts of one group's sequences: ``first_tokens`` {sequence id: its token from the
        prefill} after the shared ``prompt``."""
        ngrams, score = PromptNgrams(prompt, *self.ngram_sizes), LookupScore()
        for sequence_id, token in first_tokens.items():
            context = self._contexts[sequence_id] = PromptLookup(ngrams, score)
            context.extend([token])

    def propose(self, sequence_id: int, limit: int) -> list[int]:
        """The sequence's lookup proposal: at most ``limit`` tokens, possibly none. Called every round, sent
        or not: the whole continuation is scored when ``confirm`` follows."""
        return self._contexts[sequence_id].confident(limit, self.confidence_floor)

    def confirm(self, sequence_id: int, tokens: Sequence[int]) -> None:
        """Extend the sequence's context by the tokens the target confirmed this round (accepted proposal
        tokens, then its own), scoring the round's lookup continuation against them."""
        self._contexts[sequence_id].advance(tokens)

    def forget(self, sequence_ids: Sequence[int]) -> None:
        """Drop the contexts of finished sequences."""
        for sequence_id in sequence_ids:
            self._contexts.pop(sequence_id, None)

    def clear(self) -> None:
        """Drop every context (the batch ended)."""
        self._contexts.clear()


def lookup_proposal(sequence_id: int, tokens: list[int], greedy: bool) -> model_pb2.Proposal:
    """The wire form of a lookup proposal: its tokens, and a point distribution per token when the sequence
    samples (it was not drawn from any distribution: the target accepts it with probability p(token))."""
    return model_pb2.Proposal(sequence_id=sequence_id, token_ids=tokens, distributions=[] if greedy else [
        distribution_to_proto(point_distribution(token)) for token in tokens])
