"""Adaptive draft length (BASS): one k per round for the whole batch, from its observed acceptance.

Rule: start at ``initial``. After each round, if at least one sequence accepted all k proposed tokens,
k grows by one (the draft was the bottleneck for the best sequence); otherwise k shrinks by one, since
every sequence rejected a token and the last proposals were wasted work. k stays in [1, maximum]. Taking
the best sequence rather than the worst means a single slow sequence cannot stall the rest: its
rejected tokens cost only its own share of the verification pass.
"""

from __future__ import annotations


class DraftLength:
    """The draft length to propose this round; fixed when ``adaptive`` is False."""

    def __init__(self, initial: int, maximum: int, adaptive: bool = True) -> None:
        if not 1 <= initial <= maximum:
            raise ValueError(f"need 1 <= initial draft length ({initial}) <= maximum ({maximum})")
        self.k = initial
        self.maximum = maximum
        self.adaptive = adaptive

    def update(self, proposed: int, accepted: list[int]) -> int:
        """Record a round's per-sequence accepted lengths for a proposal of ``proposed`` tokens; returns the next k."""
        if self.adaptive and proposed and accepted:
            if max(accepted) >= proposed:
                self.k = min(self.k + 1, self.maximum)
            else:
                self.k = max(self.k - 1, 1)
        return self.k
