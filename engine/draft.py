"""The draft side of a round: roll back to what the target accepted, then propose k tokens per sequence.

A proposal starts with the prompt-lookup continuation of the sequence (``engine.prompt_lookup``), when its
tail occurred before, lookup is on and has been right more often than the model on this request, and
the draft model proposes the rest. Lookup tokens are fed to the
model as its inputs, so its cache and its own later proposals follow them; sampling sequences send a
point distribution for each, which keeps the target's rejection sampling exact.

Each sequence's proposal is as long as it is likely to pay (a per-sequence draft length): the draft keeps
an estimate of the chance that the target accepts the whole proposal so far, the product of each token's
confidence (a model token: the draft's top probability, which on held-out code matches its chance of
being the target's token, docs/design.md; a lookup token: the group's lookup acceptance rate), and stops a
sequence's proposal before the token that would take it below ``confidence_floor``. A verify is priced by
the tokens in it (on a CPU it is compute-bound), so unlikely tokens cost more than they bring; the stop
depends only on the draft's side, so the target's rejection sampling stays exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.batch import Batch, GroupInput, SequenceState, pad_windows
from engine.checkpoint import Checkpoint
from engine.errors import InvalidInput
from engine.prompt_lookup import DEFAULT_NGRAM_SIZES, LookupScore, PromptLookup, PromptNgrams, check_ngram_sizes
from engine.runtime import ModelRuntime, Prefilled
from engine.sampling import (
    CompactDistribution,
    SamplingParams,
    draft_distribution,
    point_distribution,
    process_logits,
    sample,
)

# Stop a sequence's proposal before its estimated chance of full acceptance falls below this: about where a
# verified token's cost on a 2-core CPU equals its expected saving (docs/design.md, "Per-sequence draft length").
DEFAULT_CONFIDENCE_FLOOR = 0.3


def check_confidence_floor(floor: float) -> None:
    """Raise ValueError unless ``floor`` is in [0, 1): the confidence floors a draft can stop proposals at."""
    if not 0.0 <= floor < 1.0:
        raise ValueError(f"confidence_floor must be in [0, 1), got {floor}")


@dataclass
class DraftProposal:
    """k proposed tokens of one sequence and, when sampling, the distribution each was drawn from; the first
    ``lookup_tokens`` of them came from prompt lookup."""

    sequence_id: int
    token_ids: list[int]
    distributions: list[CompactDistribution]
    lookup_tokens: int = 0


def apply_verdict(state: SequenceState, accepted_len: int, next_token: int,
                  catch_up: Sequence[int] = ()) -> None:
    """Roll the sequence back to the accepted prefix of its last proposal and queue the target's token.

    While proposing k tokens the draft cached all but the last, so after ``accepted_len`` acceptances
    the cache keeps min(accepted_len, k - 1) of them and the rest of the accepted tokens, plus the
    target's ``next_token``, become pending (no extra round trip for the rollback). ``catch_up`` tokens
    (a sequence re-joining a draft that missed rounds) are queued before ``next_token``. The confirmed
    tokens extend the sequence's lookup context.
    """
    proposed = state.proposed
    if not 0 <= accepted_len <= len(proposed):
        raise InvalidInput(f"sequence {state.sequence_id}: accepted_len {accepted_len} outside "
                           f"[0, {len(proposed)}] (the last proposal's length)")
    if proposed:
        cached = len(proposed) - 1
        keep = min(accepted_len, cached)
        state.decoded -= cached - keep
        state.pending = proposed[keep:accepted_len] + list(catch_up) + [next_token]
    else:
        state.pending = state.pending + list(catch_up) + [next_token]
    if state.lookup is not None:
        # after rounds the draft skipped, catch_up[0] is the target's token where the last proposal stopped
        # matching, so the proposal is scored on the true continuation either way
        state.lookup.advance([*proposed[:accepted_len], *catch_up, next_token])
    state.proposed = []


class DraftRuntime(ModelRuntime):
    """Proposes draft tokens for every live sequence of a batch in batched forward steps."""

    role = "draft"

    def __init__(self, checkpoint: Checkpoint, *, prompt_lookup: tuple[int, int] | None = DEFAULT_NGRAM_SIZES,
                 confidence_floor: float = DEFAULT_CONFIDENCE_FLOOR, **runtime_options: object) -> None:
        """A draft runtime (options as ``ModelRuntime``); ``prompt_lookup`` (min n, max n) starts proposals with
        prompt-lookup continuations of n-grams of those sizes, None proposes with the model alone; a sequence's
        proposal stops before its estimated chance of full acceptance drops below ``confidence_floor`` (in
        [0, 1); 0: every proposal is ``draft_len`` long). Raises ValueError for bad sizes or floor."""
        if prompt_lookup is not None:
            check_ngram_sizes(*prompt_lookup)
        check_confidence_floor(confidence_floor)
        super().__init__(checkpoint, **runtime_options)
        self.prompt_lookup = prompt_lookup
        self.confidence_floor = confidence_floor
        # A subset-vocabulary draft samples within its own support (target ids, ascending so ties break as
        # over the whole vocabulary): 7k ids instead of 49k for the default draft.
        token_map = checkpoint.token_map
        self._support = None if token_map is None else token_map.mapped_ids.sort().values
        self._support_ids = None if self._support is None else self._support.cpu().numpy()

    def _start_sequences(self, group: GroupInput, states: Sequence[SequenceState], logits: torch.Tensor,
                         result: Prefilled) -> None:
        if self.prompt_lookup is not None:
            ngrams = PromptNgrams(group.prompt_token_ids, *self.prompt_lookup)  # one index for the n samples
            score = LookupScore()  # and one score: lookup or the model, for this request
            for state in states:
                state.lookup = PromptLookup(ngrams, score)

    def _apply_verdicts(self, batch: Batch, updates: dict[int, tuple[int, int, Sequence[int]]]) -> None:
        """Check last round's verdicts (every live sequence once, token ids in the vocabulary) and apply them."""
        vocab = self.checkpoint.vocab_size
        verdicts = batch.in_row_order(updates, "updates")
        for _, token, catch_up in verdicts:
            bad = [t for t in (token, *catch_up) if not 0 <= t < vocab]
            if bad:
                raise InvalidInput(f"update token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        for state, (accepted, token, catch_up) in zip(batch.sequences, verdicts, strict=True):
            apply_verdict(state, accepted, token, catch_up)

    def _draw(self, logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
              fed: Sequence[int]) -> tuple[torch.Tensor, list[CompactDistribution | None]]:
        """One token per row that is still proposing (``fed`` a token this step), drawn from its processed
        distribution over ``logits`` (the draft's support), with one uniform from its own generator; returns
        the target ids (0 in the other rows) and, per sampling row, the compact distribution it came from."""
        probs = process_logits(logits, params)
        dense, compact = zip(*(draft_distribution(probs[row], p.greedy) for row, p in enumerate(params)), strict=True)
        drawing = [row for row, width in enumerate(fed) if width]
        drawn = torch.zeros(len(params), dtype=torch.long, device=logits.device)
        drawn[drawing] = sample(torch.stack([dense[row] for row in drawing]), [generators[row] for row in drawing])
        if self._support is None:
            return drawn, list(compact)
        return self._support[drawn], [None if c is None else c.relabeled(self._support_ids) for c in compact]

    def propose(self, batch_id: str, updates: dict[int, tuple[int, int, Sequence[int]]], draft_len: int,
                release: Iterable[int] = ()) -> list[DraftProposal]:
        """Apply last round's verdicts {sequence id: (accepted_len, next_token, catch-up tokens)} (every
        live sequence once), then propose ``draft_len`` tokens for each sequence.

        Each proposal starts with the sequence's prompt-lookup continuation (when lookup is on and finds
        one) and holds at most ``draft_len`` tokens, fewer where the confidence floor stops it (possibly
        none). Sampling sequences draw each model token from the compact distribution returned with it and
        send a point distribution with each lookup token, so the target's rejection sampling against them is
        exact. Proposals come back in row order.
        """
        if draft_len < 0:
            raise InvalidInput(f"draft_len must be >= 0, got {draft_len}")
        with self.lock:
            batch = self.get_batch(batch_id)
            self.release_in_batch(batch, release)
            self._apply_verdicts(batch, updates)
            states = batch.sequences
            proposals = [DraftProposal(s.sequence_id, [], []) for s in states]
            if draft_len == 0 or not states:
                return proposals
            tokens, widths = pad_windows([s.pending for s in states])
            params = [s.params for s in states]
            generators = [s.generator for s in states]
            looked_up = [s.lookup.propose(draft_len) if s.lookup is not None else [] for s in states]
            chance = [1.0] * len(states)  # estimated chance that the target accepts the row's whole proposal
            for step in range(draft_len):
                logits = self.forward(tokens, widths, batch.decoded(), batch.kv, last_only=True)
                if self._support is not None:  # the draft's probability is 0 elsewhere
                    logits = logits[:, self._support]
                fed = widths.tolist()
                for state, width in zip(states, fed, strict=True):
                    state.decoded += width
                    state.pending = []
                drawn, compact = self._draw(logits, params, generators, fed)
                if step == 0:  # lookup leads where it has been right more often than the model
                    looked_up = [s.lookup.choose(found, model) if s.lookup is not None else []
                                 for s, found, model in zip(states, looked_up, drawn.tolist(), strict=True)]
                confidence = torch.softmax(logits, dim=-1).amax(dim=-1).tolist() if self.confidence_floor else None
                dists = compact
                for row, found in enumerate(looked_up):
                    if step < len(found):
                        drawn[row] = found[step]
                        dists[row] = None if params[row].greedy else point_distribution(found[step])
                        if confidence is not None:
                            confidence[row] = states[row].lookup.score.lookup_confidence
                going = []
                for row, (proposal, token, dist) in enumerate(zip(proposals, drawn.tolist(), dists, strict=True)):
                    if not fed[row]:  # stopped at an earlier step
                        continue
                    if confidence is not None and chance[row] * confidence[row] < self.confidence_floor:
                        if step:  # its last proposed token was just fed: uncache it, as for a full proposal
                            states[row].decoded -= 1
                        continue
                    if confidence is not None:
                        chance[row] *= confidence[row]
                    proposal.token_ids.append(token)
                    if dist is not None:
                        proposal.distributions.append(dist)
                    going.append(row)
                if step + 1 == draft_len or not going:
                    break
                tokens, widths = drawn[:, None], torch.zeros(len(states), dtype=torch.long)
                widths[going] = 1
            # The last proposed token was never fed: the next round's window starts with it if accepted.
            for state, proposal, found in zip(states, proposals, looked_up, strict=True):
                state.proposed = list(proposal.token_ids)
                proposal.lookup_tokens = min(len(found), len(proposal.token_ids))
            return proposals
