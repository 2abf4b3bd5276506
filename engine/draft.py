"""The draft side of a round: roll back to what the target accepted, then propose k tokens per sequence."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.batch import SequenceState, pad_windows
from engine.errors import InvalidInput
from engine.runtime import ModelRuntime
from engine.sampling import CompactDistribution, draft_distribution, process_logits, sample


@dataclass
class DraftProposal:
    """k proposed tokens of one sequence and, when sampling, the distribution each was drawn from."""

    sequence_id: int
    token_ids: list[int]
    distributions: list[CompactDistribution]


def apply_verdict(state: SequenceState, accepted_len: int, next_token: int,
                  catch_up: Sequence[int] = ()) -> None:
    """Roll the sequence back to the accepted prefix of its last proposal and queue the target's token.

    While proposing k tokens the draft cached all but the last, so after ``accepted_len`` acceptances
    the cache keeps min(accepted_len, k - 1) of them and the rest of the accepted tokens, plus the
    target's ``next_token``, become pending (no extra round trip for the rollback). ``catch_up`` tokens
    (a sequence re-joining a draft that missed rounds) are queued before ``next_token``.
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
    state.proposed = []


class DraftRuntime(ModelRuntime):
    """Proposes draft tokens for every live sequence of a batch in batched forward steps."""

    role = "draft"

    def propose(self, batch_id: str, updates: dict[int, tuple[int, int, Sequence[int]]], draft_len: int,
                release: Iterable[int] = ()) -> list[DraftProposal]:
        """Apply last round's verdicts {sequence id: (accepted_len, next_token, catch-up tokens)} (every
        live sequence once), then propose ``draft_len`` tokens for each sequence.

        Sampling sequences draw each token from the compact distribution returned with it, so the
        target's rejection sampling against it is exact. Proposals come back in row order.
        """
        if draft_len < 0:
            raise InvalidInput(f"draft_len must be >= 0, got {draft_len}")
        vocab = self.checkpoint.vocab_size
        with self.lock:
            batch = self.get_batch(batch_id)
            self.release_in_batch(batch, release)
            verdicts = batch.in_row_order(updates, "updates")
            for _, token, catch_up in verdicts:
                bad = [t for t in (token, *catch_up) if not 0 <= t < vocab]
                if bad:
                    raise InvalidInput(f"update token ids {bad[:5]} outside the vocabulary [0, {vocab})")
            for state, (accepted, token, catch_up) in zip(batch.sequences, verdicts, strict=True):
                apply_verdict(state, accepted, token, catch_up)
            states = batch.sequences
            proposals = [DraftProposal(s.sequence_id, [], []) for s in states]
            if draft_len == 0 or not states:
                return proposals
            tokens, widths = pad_windows([s.pending for s in states])
            params = [s.params for s in states]
            generators = [s.generator for s in states]
            for step in range(draft_len):
                logits = self.forward(tokens, widths, batch.decoded(), batch.kv, last_only=True)
                for state, width in zip(states, widths.tolist(), strict=True):
                    state.decoded += width
                    state.pending = []
                probs = process_logits(logits, params)
                dense, compact = zip(*(draft_distribution(probs[row], p.greedy) for row, p in enumerate(params)),
                                     strict=True)
                drawn = sample(torch.stack(dense), generators)
                for proposal, token, dist in zip(proposals, drawn.tolist(), compact, strict=True):
                    proposal.token_ids.append(token)
                    if dist is not None:
                        proposal.distributions.append(dist)
                if step + 1 < draft_len:
                    tokens, widths = drawn[:, None], torch.ones(len(states), dtype=torch.long)
            # The last proposed token was never fed: the next round's window starts with it if accepted.
            for state, proposal in zip(states, proposals, strict=True):
                state.proposed = list(proposal.token_ids)
            return proposals
