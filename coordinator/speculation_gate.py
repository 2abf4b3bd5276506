"""Speculate only while it pays: a batch's round kinds measured against each other, the fastest run.

A round is one of three kinds (``ROUND_KINDS``): *draft* (the draft service proposes, the target verifies),
*lookup* (no draft call: the target verifies the coordinator's own prompt-lookup tokens, ``coordinator.lookup``)
or *plain* (one target decode step). Which emits tokens fastest depends on the model pair, the hardware, the
requests and the batch: a weak draft at a high temperature on a CPU, where verifying k tokens costs more than
a decode step, loses to plain rounds; where code repeats itself, lookup can beat a draft model that costs a
second RPC and k draft steps; on this CPU a verify's cost also jumps where its token count crosses the GEMM's
block of rows. So the gate measures: it keeps an exponential moving average of the batch's progress in tokens
per second for each kind available and runs the fastest. The kinds not measured yet run first, in
``ROUND_KINDS`` order (a batch starts speculating), so all are measured within the first rounds. Then it
probes: after ``probe_every`` rounds one round of the other kind measured longest ago keeps its figure
current, and each probe that confirms the choice doubles the gap to the next (up to ``PROBE_BACKOFF`` times
``probe_every``; one that changes it resets the gap), so a choice that keeps holding costs few probes.

Progress is what a round did for the requests' ends (``request_progress``: how far each request's slowest
sample rose), not every token emitted: at a high temperature the n samples' acceptances differ, and lookup or
draft tokens that only let some samples run further ahead of the slowest one do not bring the request's end
closer. A round counts for the kind chosen, not for what it turned out to be: a lookup round where lookup
found nothing runs as a plain step, and that is part of what choosing lookup delivers (the owner records the
kind it was given). No kind changes the output: greedy output stays the target's, and a sampled token comes
from the target's distribution whichever kind produced it.

The figures belong to a batch's *mix*: whether any of its sequences samples (temperature > 0) or all are
greedy, and how many sequences it has, in powers of two (1, 2, 3–4, 5–8, ...). Acceptance, and with it what
speculation is worth, differs most between greedy and sampled (a draft that pays at greedy can lose at
T = 0.8), so a greedy batch is never judged by figures a sampled one left, and the other way round. A
batch's tokens per second follow its size, so a kind measured while the batch was small is not compared
with one measured once requests joined: a batch that grows or shrinks past a power of two measures its kinds
again. The owner calls ``reset`` when a batch ends: the next batch may be another workload.

Which mixes it judges is a mode (``serve coordinator --speculation-gate off|sampled|on``): ``on``, the
default, gates both mixes; ``sampled`` gates batches with a sampled sequence and always runs the first kind
available (the draft's) for all-greedy ones; ``off`` always runs the first. Its remaining weakness: a kind's
figure is set by the rounds it ran, and a request's first rounds, before prompt lookup has earned trust, are
its worst, so with short requests it can pick a slower kind (docs/benchmarks.md, runs E–M).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

ROUND_KINDS = ("draft", "lookup", "plain")  # the kinds of round, in the order a batch first tries them
PROBE_EVERY = 16
PROBE_BACKOFF = 4  # a probe that confirms the choice doubles the gap to the next, up to this many times PROBE_EVERY
GATE_MODES = ("off", "sampled", "on")  # which batch mixes the gate judges: none, those with a sampled sequence, all
DEFAULT_GATE_MODE = "on"
SMOOTHING = 0.25  # weight of the newest round in the moving averages


@dataclass
class _Figures:
    """One mix's measured tokens per second of each round kind, its rounds so far, and when it next probes."""

    next_probe: int  # index of the round that runs another kind than the fastest
    gap: int  # rounds from one probe to the next
    rate: dict[str, float] = field(default_factory=dict)  # kind -> moving average (measured kinds only)
    measured_at: dict[str, int] = field(default_factory=dict)  # kind -> index of the round that last measured it
    rounds: int = 0


def request_progress(before: Sequence[int], after: Sequence[int], finished: Sequence[bool]) -> int:
    """What a round did for one request, in tokens: the number of its samples in the round times how far the
    shortest of those left unfinished rose (``before``/``after``: each sample's length around the round;
    ``finished``: whether it finished in it), or every token they added when none is left.

    A request of n samples ends with its slowest sample, so tokens that only lengthen the others' lead do not
    bring its end closer; summed over rounds, the rises of the shortest length add up to the progress that
    does. A plain round is credited one token per sample, and samples that advance alike (a request's greedy
    samples are identical) every token. The samples that finish in the round are left out of the minimum on
    both sides, so an end of sequence is not credited to the round's kind."""
    left = [i for i, done in enumerate(finished) if not done]
    if not left:
        return sum(after) - sum(before)
    return len(before) * (min(after[i] for i in left) - min(before[i] for i in left))


class SpeculationGate:
    """Which kind of round runs next, for each mix (any sampled sequence or all greedy; the batch's size in
    powers of two)."""

    def __init__(self, probe_every: int = PROBE_EVERY, smoothing: float = SMOOTHING, sampled_only: bool = False
                 ) -> None:
        """A gate probing every ``probe_every``-th round (>= 2), averaging with weight ``smoothing`` (in (0, 1]);
        with ``sampled_only`` it judges only batches with a sampled sequence and always runs the first kind
        available for all-greedy ones. Raises ValueError for out-of-range values."""
        if probe_every < 2:
            raise ValueError(f"probe_every must be >= 2, got {probe_every}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.probe_every = probe_every
        self.smoothing = smoothing
        self.sampled_only = sampled_only
        self._mixes: dict[tuple[bool, int], _Figures] = {}

    def rate(self, sampled: bool = False, sequences: int = 1) -> dict[str, float]:
        """The mix's moving averages of tokens per second, by kind, of the kinds measured since the last
        ``reset``."""
        return dict(self._figures(sampled, sequences).rate)

    def fastest(self, kinds: Sequence[str], sampled: bool = False, sequences: int = 1) -> str:
        """The kind of ``kinds`` with the highest measured rate for the mix (``kinds[0]`` while none is
        measured)."""
        rate = self._figures(sampled, sequences).rate
        measured = [kind for kind in kinds if kind in rate]
        return max(measured, key=rate.__getitem__) if measured else kinds[0]

    def choose(self, kinds: Sequence[str], sampled: bool = False, sequences: int = 1) -> str:
        """The kind of the next round of a batch of this mix (``sampled``: any sequence samples; ``sequences``:
        its live sequences), among the ``kinds`` available now (in
        ``ROUND_KINDS`` order; at least one). ``kinds[0]`` when it is the only one or the gate does not judge
        the mix; else the first kind not measured yet; else the fastest, except in a probe round, which runs
        the other kind measured longest ago: the first at round ``probe_every``, each next one ``probe_every``
        rounds later, or twice the last gap (up to ``PROBE_BACKOFF`` times ``probe_every``) when the probe
        confirmed the choice."""
        if len(kinds) == 1 or (self.sampled_only and not sampled):
            return kinds[0]
        figures = self._figures(sampled, sequences)
        unmeasured = [kind for kind in kinds if kind not in figures.rate]
        if unmeasured:
            return unmeasured[0]
        fastest = self.fastest(kinds, sampled, sequences)
        if figures.rounds < figures.next_probe:
            return fastest
        return min((kind for kind in kinds if kind != fastest), key=figures.measured_at.__getitem__)

    def record(self, kind: str, tokens: int, seconds: float, sampled: bool = False, sequences: int = 1) -> None:
        """Account one finished round of ``kind`` for the mix: ``tokens`` of progress of the batch's requests in
        ``seconds`` (``request_progress``; nothing for a mix the gate does not judge; no figure for a round with no
        progress)."""
        if self.sampled_only and not sampled:
            return
        figures = self._figures(sampled, sequences)
        index = figures.rounds
        figures.rounds += 1
        if seconds > 0 and tokens > 0:
            rate = tokens / seconds
            old = figures.rate.get(kind)
            figures.rate[kind] = rate if old is None else old + self.smoothing * (rate - old)
            figures.measured_at[kind] = index
        if index >= figures.next_probe:  # the probe's round: the kind it ran still slower backs the next off
            confirmed = self.fastest(list(figures.rate) or [kind], sampled, sequences) != kind
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

    def _figures(self, sampled: bool, sequences: int) -> _Figures:
        mix = (sampled, max(sequences - 1, 0).bit_length())  # sizes 1, 2, 3-4, 5-8, ... share figures
        figures = self._mixes.get(mix)
        if figures is None:
            figures = self._mixes[mix] = _Figures(next_probe=self.probe_every - 1, gap=self.probe_every)
        return figures
