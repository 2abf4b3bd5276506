"""Speculate only while it pays: a batch's speculative rounds against its plain decode rounds, measured.

Speculation wins when the draft is good and verification is cheap, and loses otherwise (a weak draft at a
high temperature on a CPU, where verifying k tokens costs more than a decode step). Which holds depends on
the model pair, the hardware, the requests and the batch, so the gate measures it: it keeps an exponential
moving average of the batch's emitted tokens per second for speculative rounds and for plain rounds (no
draft call, one target decode step), runs the better kind, and every ``probe_every``-th round runs the other
kind once to keep its figure current. It starts speculating, and probes plain decoding after its first
``probe_every`` rounds. A plain round leaves the output unchanged: greedy output stays the target's, and a
sampled token comes from the target's distribution either way.

Opt-in (``serve coordinator --speculation-gate``). Its known weakness: the figure for speculation is set by
whatever speculative rounds ran, and a request's first rounds, before the draft's prompt lookup has earned
trust, are its worst, so with short requests it can run plain rounds where speculation would have paid.
"""

from __future__ import annotations

PROBE_EVERY = 16
SMOOTHING = 0.25  # weight of the newest round in the moving averages


class SpeculationGate:
    """Whether the next round speculates."""

    def __init__(self, probe_every: int = PROBE_EVERY, smoothing: float = SMOOTHING) -> None:
        if probe_every < 2:
            raise ValueError(f"probe_every must be >= 2, got {probe_every}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.probe_every = probe_every
        self.smoothing = smoothing
        self.rate: dict[bool, float | None] = {True: None, False: None}  # speculative? -> tokens per second
        self._rounds = 0

    @property
    def better(self) -> bool:
        """Whether speculative rounds are the faster kind (True until plain rounds were measured)."""
        plain, speculative = self.rate[False], self.rate[True]
        return plain is None or speculative is None or speculative >= plain

    def speculate(self) -> bool:
        """True when the next round should propose draft tokens: the better kind, except for a probe round
        of the other kind every ``probe_every`` rounds."""
        probe = (self._rounds + 1) % self.probe_every == 0
        return self.better != probe

    def record(self, speculated: bool, tokens: int, seconds: float) -> None:
        """Account one finished round: ``tokens`` emitted by the batch in ``seconds``."""
        self._rounds += 1
        if seconds <= 0 or tokens <= 0:
            return
        rate = tokens / seconds
        old = self.rate[speculated]
        self.rate[speculated] = rate if old is None else old + self.smoothing * (rate - old)
