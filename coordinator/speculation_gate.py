"""Speculate only while it pays: a batch's speculative rounds against its plain decode rounds, measured.

Speculation wins when the draft is good and verification is cheap, and loses otherwise (a weak draft at a
high temperature on a CPU, where verifying k tokens costs more than a decode step). Which holds depends on
the model pair, the hardware, the requests and the batch, so the gate measures it: it keeps an exponential
moving average of the batch's emitted tokens per second for speculative rounds and for plain rounds (no
draft call, one target decode step) and runs the better kind. It starts speculating and runs a plain round
second, so both kinds are measured from the third round on. Then it probes: a round of the slower kind
after ``probe_every`` rounds keeps that figure current, and each probe that confirms the choice doubles
the gap to the next (up to ``PROBE_BACKOFF`` times ``probe_every``; one that changes it resets the gap), so
a choice that keeps holding costs few probes. A plain round leaves the output unchanged: greedy output
stays the target's, and a sampled token comes from the target's distribution either way.

The figures belong to a batch's *mix*: whether any of its sequences samples (temperature > 0) or all are
greedy. Acceptance, and with it what speculation is worth, differs most between the two (a draft that pays
at greedy can lose at T = 0.8), so a greedy batch is never judged by figures a sampled one left, and the
other way round. The owner calls ``reset`` when a batch ends: the next batch may be another workload.

Which mixes it judges is a mode (``serve coordinator --speculation-gate off|sampled|on``): ``sampled``, the
default, gates batches with a sampled sequence and always speculates for all-greedy ones; ``on`` gates
both. The reason is its remaining weakness: the figure for speculation is set by whatever speculative
rounds ran, and a request's first rounds, before the draft's prompt lookup has earned trust, are its
worst, so with short requests it can run plain rounds where speculation would have paid. On the default
pair that costs greedy batches more than it saves them, and saves sampled ones more than it costs
(docs/benchmarks.md, runs E–H).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROBE_EVERY = 16
PROBE_BACKOFF = 4  # a probe that confirms the choice doubles the gap to the next, up to this many times PROBE_EVERY
GATE_MODES = ("off", "sampled", "on")  # which batch mixes the gate judges: none, those with a sampled sequence, all
DEFAULT_GATE_MODE = "sampled"
SMOOTHING = 0.25  # weight of the newest round in the moving averages


@dataclass
class _Figures:
    """One mix's measured tokens per second of each round kind, its rounds so far, and when it next probes."""

    next_probe: int  # index of the round that runs the slower kind
    gap: int  # rounds from one probe to the next
    rate: dict[bool, float | None] = field(default_factory=lambda: {True: None, False: None})  # speculative?
    rounds: int = 0


class SpeculationGate:
    """Whether the next round speculates, for each mix (any sampled sequence, or all greedy)."""

    def __init__(self, probe_every: int = PROBE_EVERY, smoothing: float = SMOOTHING, sampled_only: bool = False
                 ) -> None:
        """A gate probing every ``probe_every``-th round (>= 2), averaging with weight ``smoothing`` (in (0, 1]);
        with ``sampled_only`` it judges only batches with a sampled sequence and always speculates for
        all-greedy ones. Raises ValueError for out-of-range values."""
        if probe_every < 2:
            raise ValueError(f"probe_every must be >= 2, got {probe_every}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.probe_every = probe_every
        self.smoothing = smoothing
        self.sampled_only = sampled_only
        self._mixes: dict[bool, _Figures] = {}

    def rate(self, sampled: bool = False) -> dict[bool, float | None]:
        """The mix's moving averages of tokens per second: speculative (True) and plain (False) rounds;
        None where that kind has not run since the last ``reset``."""
        return dict(self._figures(sampled).rate)

    def better(self, sampled: bool = False) -> bool:
        """Whether speculative rounds are the faster kind for the mix (True until both kinds were measured)."""
        rate = self._figures(sampled).rate
        plain, speculative = rate[False], rate[True]
        return plain is None or speculative is None or speculative >= plain

    def speculate(self, sampled: bool = False) -> bool:
        """True when the next round of a batch of this mix should propose draft tokens. The first round
        speculates and, from the second on, a kind not measured yet runs (so both are measured by the third
        round, not only at the first probe); then the better kind, except for a probe round of the other
        kind: the first at round ``probe_every``, each next one ``probe_every`` rounds later, or twice the
        last gap (up to ``PROBE_BACKOFF`` times ``probe_every``) when the probe confirmed the choice.
        Always True for an all-greedy batch when the gate judges sampled batches only."""
        if self.sampled_only and not sampled:
            return True
        figures = self._figures(sampled)
        unmeasured = [kind for kind in (True, False) if figures.rate[kind] is None]
        if figures.rounds >= 1 and unmeasured:
            return unmeasured[0]
        return self.better(sampled) != (figures.rounds >= figures.next_probe)

    def record(self, speculated: bool, tokens: int, seconds: float, sampled: bool = False) -> None:
        """Account one finished round of the mix: ``tokens`` emitted by the batch in ``seconds`` (nothing for a
        mix the gate does not judge)."""
        if self.sampled_only and not sampled:
            return
        figures = self._figures(sampled)
        index = figures.rounds
        figures.rounds += 1
        if seconds > 0 and tokens > 0:
            rate = tokens / seconds
            old = figures.rate[speculated]
            figures.rate[speculated] = rate if old is None else old + self.smoothing * (rate - old)
        if index >= figures.next_probe:  # the probe's round: the kind it ran still slower backs the next off
            confirmed = self.better(sampled) != speculated
            figures.gap = min(2 * figures.gap, PROBE_BACKOFF * self.probe_every) if confirmed else self.probe_every
            figures.next_probe = index + figures.gap

    def reset(self) -> None:
        """Forget every figure: the next round starts as a new gate's would."""
        self._mixes.clear()

    @classmethod
    def for_mode(cls, mode: str, probe_every: int = PROBE_EVERY) -> SpeculationGate | None:
        """The gate of a ``GATE_MODES`` mode: None for ``off``. Raises ValueError for another mode or a bad
        ``probe_every``."""
        if mode not in GATE_MODES:
            raise ValueError(f"speculation gate mode must be one of {GATE_MODES}, got {mode!r}")
        return None if mode == "off" else cls(probe_every, sampled_only=mode == "sampled")

    def _figures(self, sampled: bool) -> _Figures:
        figures = self._mixes.get(sampled)
        if figures is None:
            figures = self._mixes[sampled] = _Figures(next_probe=self.probe_every - 1, gap=self.probe_every)
        return figures
