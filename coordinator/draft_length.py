"""Adaptive draft length (BASS): one k per round for the whole batch, from its observed acceptance.

Rule: start at ``initial``. After each round, look at the share of live sequences that accepted all k
proposed tokens: if at least half did, k grows by one (the draft is the bottleneck for the typical
sequence); if fewer than a quarter did, k shrinks by one (most proposals were partly wasted); in between
k stays. k stays in [1, maximum]. Following the median sequence, not the best or the worst, means a
single slow sequence cannot stall the rest and a single lucky one cannot inflate k for everyone —
with greedy decoding and a good draft k climbs, with high-temperature sampling it settles low.

Where the draft cuts proposals short by its own confidence (per-sequence draft lengths, ``engine.draft``),
k is a cap: only the sequences whose proposal reached it say whether it binds, so the shares are of
those; a round where none reached it leaves k alone.

With a ``SpeculationGate`` (``coordinator.speculation_gate``) a round may also call no draft (k = 0: a
lookup or a plain round) while such rounds emit tokens faster than the draft's for the batch's mix
(``sampled``: whether any of its sequences samples). ``reset`` starts over, for a new batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.speculation_gate import SpeculationGate

GROW_SHARE = 0.5
SHRINK_SHARE = 0.25


class DraftLength:
    """The draft length to propose this round; fixed when ``adaptive`` is False."""

    def __init__(self, initial: int, maximum: int, adaptive: bool = True, gate: SpeculationGate | None = None
                 ) -> None:
        if not 1 <= initial <= maximum:
            raise ValueError(f"need 1 <= initial draft length ({initial}) <= maximum ({maximum})")
        self.initial = initial
        self.k = initial
        self.maximum = maximum
        self.adaptive = adaptive
        self.gate = gate

    def for_round(self, kinds: Sequence[str] = ("draft", "plain"), sampled: bool = False, sequences: int = 1
                  ) -> tuple[str, int]:
        """The kind of the next round of a batch of this mix (``sampled``, ``sequences`` live) among the available
        ``kinds`` (``ROUND_KINDS`` order; the gate's choice, else the first) and the k the draft proposes in it (0
        unless a draft round)."""
        kind = kinds[0] if self.gate is None else self.gate.choose(kinds, sampled, sequences)
        return kind, self.k if kind == "draft" else 0

    def update(self, proposed: int, accepted: list[int], seconds: float = 0.0,
               lengths: list[int] | None = None, sampled: bool = False, kind: str | None = None,
               progress: int | None = None) -> int:
        """Record a round's per-sequence accepted lengths for draft proposals of at most ``proposed`` tokens
        (0: no draft call; ``lengths``: each sequence's proposal length, None: all ``proposed``) and its wall
        time, for the gate under the batch's mix and the round's ``kind`` (None: draft, or plain when
        ``proposed`` is 0), which credits the round with ``progress`` tokens (``speculation_gate.request_progress``;
        None: every accepted token and one more per sequence); returns the next speculative k."""
        if self.gate is not None:
            kind = kind or ("draft" if proposed else "plain")
            self.gate.record(kind, sum(accepted) + len(accepted) if progress is None else progress, seconds,
                             sampled, len(accepted))
        capped = accepted if lengths is None else [a for a, n in zip(accepted, lengths, strict=True) if n >= proposed]
        if self.adaptive and proposed and capped:
            full = sum(a >= proposed for a in capped) / len(capped)
            if full >= GROW_SHARE:
                self.k = min(self.k + 1, self.maximum)
            elif full < SHRINK_SHARE:
                self.k = max(self.k - 1, 1)
        return self.k

    def reset(self) -> None:
        """Back to the initial k and a gate with no figures, as for a fresh batch."""
        self.k = self.initial
        if self.gate is not None:
            self.gate.reset()
