"""The target side of a round: score every proposal in one batched pass and accept a prefix of it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from opentelemetry import trace

from engine.batch import GroupInput, SequenceState, pad_windows
from engine.errors import InvalidInput
from engine.runtime import ModelRuntime, Prefilled
from engine.sampling import (
    CompactDistribution,
    greedy_accept,
    process_logits,
    sample,
    token_logprobs,
    verify_windows,
)

_tracer = trace.get_tracer("specserve.engine")


@dataclass
class Verdict:
    """How many proposed tokens the target accepted, and the token it appends after them."""

    sequence_id: int
    accepted_len: int
    next_token_id: int
    # with ``GroupInput.logprobs``: the model's log-probability of each accepted token, then of the next one
    logprobs: list[float] = field(default_factory=list)


class TargetRuntime(ModelRuntime):
    """Samples first tokens at prefill and verifies draft proposals (greedy or lossless sampling)."""

    role = "target"

    def _start_sequences(self, group: GroupInput, states: Sequence[SequenceState], logits: torch.Tensor,
                         result: Prefilled) -> None:
        params = [s.params for s in states]
        rows = logits[None].expand(len(states), -1)
        first = sample(process_logits(rows, params), [s.generator for s in states])
        for state, token in zip(states, first.tolist(), strict=True):
            state.pending = [token]
            result.first_tokens[state.sequence_id] = token
        if group.logprobs:
            result.first_logprobs.update(zip([s.sequence_id for s in states], token_logprobs(rows, first), strict=True))

    def _check_proposal(self, state: SequenceState, tokens: list[int],
                        distributions: list[CompactDistribution]) -> None:
        vocab = self.checkpoint.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidInput(f"sequence {state.sequence_id}: proposed token ids {bad[:5]} outside [0, {vocab})")
        if not state.params.greedy and len(distributions) != len(tokens):
            raise InvalidInput(f"sequence {state.sequence_id}: a sampling sequence needs one draft distribution "
                               f"per proposed token ({len(tokens)}), got {len(distributions)}")

    def verify(self, batch_id: str, proposals: dict[int, tuple[list[int], list[CompactDistribution]]],
               release: Iterable[int] = ()) -> list[Verdict]:
        """Verify {sequence id: (draft tokens, draft distributions)} for every live sequence in one
        forward pass over ragged windows [pending token, draft tokens...].

        Greedy sequences accept while the draft matches the target's argmax; sampling sequences use
        rejection sampling, so their output has exactly the target's distribution. An empty proposal
        is a plain decode step. Verdicts come back in row order; a sequence whose group asked for logprobs gets
        the model's log-probability of each token it confirms (``sampling.token_logprobs``).
        """
        with self.lock:
            batch = self.get_batch(batch_id)
            self.release_in_batch(batch, release)
            states = batch.sequences
            if not states:
                return []
            ordered = batch.in_row_order(proposals, "proposals")
            for state, (tokens, dists) in zip(states, ordered, strict=True):
                self._check_proposal(state, tokens, dists)
            windows = [s.pending + tokens for s, (tokens, _) in zip(states, ordered, strict=True)]
            tokens, widths = pad_windows(windows)
            logits = self.forward(tokens, widths, batch.decoded(), batch.kv, last_only=False)
            with _tracer.start_as_current_span("target.accept"):  # no-op unless the service traces
                accepted, nxt = self._decide(states, [dists for _, dists in ordered], logits, tokens[:, 1:],
                                             widths - 1)
            accepted_lens, next_tokens = accepted.tolist(), nxt.tolist()
            logprobs = _confirmed_logprobs(states, logits, tokens, accepted_lens, next_tokens)
            verdicts = []
            for row, (state, a, c) in enumerate(zip(states, accepted_lens, next_tokens, strict=True)):
                state.decoded += 1 + a
                state.pending = [c]
                verdicts.append(Verdict(state.sequence_id, a, c, logprobs.get(row, [])))
            return verdicts

    def _decide(self, states: Sequence[SequenceState], distributions: Sequence[list[CompactDistribution]],
                logits: torch.Tensor, draft_tokens: torch.Tensor, draft_lens: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted_len [B], next_token [B]) on the host for the rows' windows (``logits`` [B, K+1, V]):
        greedy rows from the logits' argmax alone, sampling rows by lossless rejection sampling over their
        processed distributions, built only for the positions each row reaches (up to its first rejection)."""
        rows, _, vocab = logits.shape
        accepted = torch.zeros(rows, dtype=torch.long)
        nxt = torch.zeros(rows, dtype=torch.long)
        greedy = [i for i, s in enumerate(states) if s.params.greedy]
        sampling = [i for i, s in enumerate(states) if not s.params.greedy]
        if greedy:
            index = torch.tensor(greedy)
            top = _rows(logits, index).argmax(dim=-1)
            a, c = greedy_accept(top, draft_tokens[index], draft_lens[index])
            accepted[index], nxt[index] = a.cpu(), c.cpu()
        if sampling:
            index = torch.tensor(sampling)
            window = _rows(logits, index)
            params = [states[i].params for i in sampling]
            proposed = [distributions[i] for i in sampling]

            def target_probs(rows: torch.Tensor, position: int) -> torch.Tensor:
                return process_logits(window[rows.to(window.device), position], [params[r] for r in rows.tolist()])

            def draft_probs(rows: torch.Tensor, position: int) -> torch.Tensor:
                return torch.stack([proposed[r][position].to_dense(vocab) for r in rows.tolist()])

            a, c = verify_windows(target_probs, draft_probs, draft_tokens[index], draft_lens[index],
                                  torch.zeros(len(sampling), dtype=torch.bool),
                                  [states[i].generator for i in sampling], vocab)
            accepted[index], nxt[index] = a, c
        return accepted, nxt


def _confirmed_logprobs(states: Sequence[SequenceState], logits: torch.Tensor, windows: torch.Tensor,
                        accepted: list[int], next_tokens: list[int]) -> dict[int, list[float]]:
    """{row: log-probabilities of its confirmed tokens} for the rows whose sequences asked for logprobs: window
    position i (``logits [B, W, V]``) scores the row's draft token i (``windows[:, i + 1]``) for the accepted
    ones and then the next token at position ``accepted``."""
    rows, positions, tokens = [], [], []
    for row, state in enumerate(states):
        if state.logprobs:
            count = accepted[row] + 1
            rows += [row] * count
            positions += range(count)
            tokens += [*windows[row, 1:count].tolist(), next_tokens[row]]
    if not rows:
        return {}
    index = torch.tensor(rows, device=logits.device), torch.tensor(positions, device=logits.device)
    values = token_logprobs(logits[index], torch.tensor(tokens))
    out: dict[int, list[float]] = {}
    for row, value in zip(rows, values, strict=True):
        out.setdefault(row, []).append(value)
    return out


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows ``index`` (host, ascending) of x: x itself, uncopied, when they are all of its rows."""
    return x if len(index) == x.shape[0] else x[index.to(x.device)]
