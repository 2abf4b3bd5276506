"""The adaptive draft-length rule."""

from __future__ import annotations

import pytest

from coordinator.draft_length import DraftLength
from coordinator.speculation_gate import ROUND_KINDS, SpeculationGate, request_progress


def test_grows_when_most_sequences_take_everything_and_stays_bounded():
    rule = DraftLength(4, 6)
    assert rule.update(4, [4, 4, 4, 1]) == 5
    assert rule.update(5, [5, 5, 0]) == 6
    assert rule.update(6, [6, 6]) == 6  # bounded by the maximum


def test_one_lucky_or_one_slow_sequence_does_not_decide():
    rule = DraftLength(4, 8)
    assert rule.update(4, [4, 0, 1, 0, 2, 1, 0, 0]) == 3  # one lucky sequence of eight: shrink
    assert rule.update(3, [3, 3, 3, 3, 3, 3, 3, 0]) == 4  # one slow sequence of eight: grow
    assert rule.update(4, [4, 4, 1, 1, 0, 2]) == 4  # a third took everything: hold


def test_shrinks_to_one_and_fixed_mode_never_moves():
    rule = DraftLength(2, 8)
    for _ in range(5):
        rule.update(rule.k, [0, 0, 1])
    assert rule.k == 1
    fixed = DraftLength(3, 8, adaptive=False)
    assert fixed.update(3, [3, 3, 3]) == 3 and fixed.update(3, [0]) == 3
    assert fixed.update(0, []) == 3


def test_rejects_bad_bounds():
    with pytest.raises(ValueError):
        DraftLength(0, 4)
    with pytest.raises(ValueError):
        DraftLength(5, 4)


LETTERS = {"draft": "S", "lookup": "L", "plain": "p"}
TWO_KINDS = ("draft", "plain")


def run_rounds(gate: SpeculationGate, rounds: int, speculative_rate: float, plain_rate: float,
               sampled: bool = False, lookup_rate: float | None = None) -> str:
    """Run ``rounds`` rounds at the given tokens per second of each kind (lookup rounds only with a
    ``lookup_rate``); returns the kinds run, one letter per round: S draft, L lookup, p plain."""
    rates = {"draft": speculative_rate, "lookup": lookup_rate, "plain": plain_rate}
    kinds = tuple(kind for kind in ROUND_KINDS if rates[kind] is not None)
    run = ""
    for _ in range(rounds):
        kind = gate.choose(kinds, sampled)
        run += LETTERS[kind]
        gate.record(kind, 8, 8 / rates[kind], sampled)
    return run


def test_gate_runs_the_faster_kind_and_probes_the_other():
    gate = SpeculationGate(probe_every=4)
    assert run_rounds(gate, 8, speculative_rate=200.0, plain_rate=100.0) == "SpSpSSSS"  # both measured, a probe
    kinds = run_rounds(gate, 16, speculative_rate=50.0, plain_rate=100.0)  # speculation stopped paying
    assert kinds[-8:] == "pppppppp"
    kinds = run_rounds(gate, 40, speculative_rate=400.0, plain_rate=100.0)  # it pays again: back to it
    assert kinds == "pppS" + "SSSp" + "SSSSSSSp" + "SSSSSSSSSSSSSSSp" + "SSSSSSSS"  # probes back off: 4, 8, 16


def test_probes_that_confirm_the_choice_back_off_to_four_times_the_interval():
    gate = SpeculationGate(probe_every=4)
    kinds = run_rounds(gate, 48, speculative_rate=50.0, plain_rate=100.0)
    assert [i for i, kind in enumerate(kinds) if kind == "S"] == [0, 3, 11, 27, 43]  # gaps 8, 16, 16


def test_three_kinds_are_measured_in_order_then_the_fastest_runs_and_probes_take_turns():
    """Draft, lookup and plain rounds each run once first; then the fastest (lookup here), and each probe
    re-measures the other kind whose figure is oldest, so both slower kinds stay measured."""
    gate = SpeculationGate(probe_every=4)
    kinds = run_rounds(gate, 28, speculative_rate=100.0, plain_rate=80.0, lookup_rate=150.0)
    assert kinds == "SLp" + "S" + "L" * 7 + "p" + "L" * 15 + "S"  # probes at 3, 11, 27 (gaps 8, 16)
    assert gate.rate() == {"draft": 100.0, "lookup": 150.0, "plain": 80.0}
    assert gate.fastest(("draft", "plain")) == "draft"  # without lookup (its rounds unavailable) the draft's
    assert gate.choose(("plain",)) == "plain"  # a single kind is not judged


def test_draft_length_with_a_gate_proposes_nothing_in_plain_rounds():
    gate = SpeculationGate(probe_every=2)
    rule = DraftLength(3, 8, gate=gate)  # a batch of two sequences
    assert rule.for_round(sequences=2) == ("draft", 3)
    rule.update(3, [3, 3], seconds=1.0)  # k grows to 4 ...
    assert rule.for_round(sequences=2) == ("plain", 0)  # ... but this round measures plain decoding
    assert rule.update(0, [0, 0], seconds=0.1) == 4  # a plain round leaves k alone
    assert rule.for_round(("draft", "lookup", "plain"), sequences=2) == ("lookup", 0)  # a kind not measured yet runs
    assert rule.update(0, [2, 1], seconds=0.1, kind="lookup") == 4  # a lookup round's tokens count for lookup
    assert gate.rate(sequences=2) == {"draft": 8.0, "plain": 20.0, "lookup": 50.0}
    assert DraftLength(3, 8).for_round() == ("draft", 3)  # no gate: always the first kind
    assert DraftLength(3, 8).for_round(("lookup", "plain")) == ("lookup", 0)


def test_gate_keeps_greedy_and_sampled_batches_apart():
    """Speculation that loses on sampled batches does not stop it on greedy ones, and the other way round."""
    gate = SpeculationGate(probe_every=4)
    run_rounds(gate, 8, speculative_rate=50.0, plain_rate=100.0, sampled=True)  # speculation at half the plain rate
    assert gate.fastest(TWO_KINDS, sampled=True) == "plain"
    assert gate.choose(TWO_KINDS, sampled=False) == "draft"
    assert gate.rate(sampled=False) == {}
    # greedy batches: speculation twice as fast, probed as a fresh gate would
    assert run_rounds(gate, 8, speculative_rate=200.0, plain_rate=100.0, sampled=False) == "SpSpSSSS"
    assert gate.fastest(TWO_KINDS, sampled=True) == "plain"  # the sampled figures are untouched


def test_gate_measures_both_kinds_in_its_first_rounds():
    """The second round runs the kind not measured yet (plain), so a losing speculation stops at round 3
    rather than at the first probe; a kind whose round gave no figure is tried again."""
    gate = SpeculationGate(probe_every=16)
    assert run_rounds(gate, 4, speculative_rate=50.0, plain_rate=100.0) == "Sppp"
    fresh = SpeculationGate(probe_every=16)
    assert fresh.choose(TWO_KINDS) == "draft"
    fresh.record("draft", 0, 1.0)  # a draft round that emitted nothing: still unmeasured
    assert fresh.choose(TWO_KINDS) == "draft"


def test_reset_forgets_the_figures_and_the_grown_k():
    gate = SpeculationGate(probe_every=2)
    rule = DraftLength(3, 8, gate=gate)
    rule.update(3, [3, 3], seconds=1.0)
    rule.update(0, [0, 0], seconds=0.01)  # plain rounds far faster: the gate would stop speculating
    assert rule.k == 4 and gate.fastest(TWO_KINDS, sequences=2) == "plain"
    rule.reset()
    assert rule.k == 3 and gate.rate(sequences=2) == {}
    assert rule.for_round() == ("draft", 3)  # the first round of the fresh batch speculates again


def test_sampled_mode_gates_sampled_batches_and_always_speculates_for_greedy_ones():
    """Mode ``sampled``: plain rounds that win stop speculation on sampled batches only; ``on`` judges both."""
    gate = SpeculationGate.for_mode("sampled", probe_every=4)
    assert run_rounds(gate, 8, speculative_rate=50.0, plain_rate=100.0) == "S" * 8  # greedy: not judged
    assert gate.rate(sampled=False) == {}
    assert run_rounds(gate, 8, speculative_rate=50.0, plain_rate=100.0, sampled=True) == "SppSpppp"
    everywhere = SpeculationGate.for_mode("on", probe_every=4)
    assert run_rounds(everywhere, 8, speculative_rate=50.0, plain_rate=100.0) == "SppSpppp"
    assert SpeculationGate.for_mode("off") is None


def test_the_gate_credits_a_round_with_the_progress_it_is_given():
    """The owner's count (``request_progress``: tokens past a stop or length limit are not output, and a lead over
    the slowest sample is not progress) replaces every accepted token."""
    gate = SpeculationGate(probe_every=16)
    rule = DraftLength(4, 8, gate=gate)
    rule.update(4, [4, 4], seconds=1.0, progress=3)  # 10 tokens confirmed, 3 kept (both sequences at their limit)
    assert gate.rate(sequences=2) == {"draft": 3.0}
    rule.update(0, [0, 0], seconds=1.0)  # without a count: every confirmed token
    assert gate.rate(sequences=2) == {"draft": 3.0, "plain": 2.0}


def test_gate_measures_again_when_the_batch_grows_past_a_power_of_two():
    """A kind measured on one sequence is not compared with one measured once seven more joined: at eight
    sequences both kinds run first again, and the draft, faster at every size here, wins there too."""
    gate = SpeculationGate(probe_every=16)
    gate.record("draft", 2, 0.1, sequences=1)  # one sequence: 20 tokens/s
    assert gate.choose(TWO_KINDS, sequences=8) == "draft"  # eight: nothing measured yet, the first kind
    gate.record("draft", 16, 0.15, sequences=8)  # 107 tokens/s
    assert gate.choose(TWO_KINDS, sequences=8) == "plain"
    gate.record("plain", 8, 0.1, sequences=7)  # 80 tokens/s; 5-8 sequences share figures
    assert gate.choose(TWO_KINDS, sequences=6) == "draft"
    assert gate.choose(TWO_KINDS, sequences=1) == "plain"  # one sequence: plain still unmeasured there
    assert gate.rate(sequences=1) == {"draft": 20.0} and set(gate.rate(sequences=5)) == {"draft", "plain"}


def test_a_round_is_credited_with_the_rise_of_its_requests_slowest_sample():
    """``request_progress``: n samples times the rise of the shortest unfinished one; a plain round gives one
    token per sample, samples that advance alike are credited every token, and a lead that grows is not."""
    assert request_progress([5, 5, 5], [6, 6, 6], [False] * 3) == 3  # a plain round
    assert request_progress([5, 5], [9, 9], [False, False]) == 8  # identical greedy samples: every token
    assert request_progress([5, 5, 5, 5], [9, 6, 8, 9], [False] * 4) == 4  # the slowest rose by one
    assert request_progress([5, 9], [8, 10], [False, False]) == 6  # the slowest caught up by 3
    assert request_progress([7, 5], [8, 6], [True, False]) == 2  # a finished sample does not hold it back
    assert request_progress([7, 5], [8, 6], [False, True]) == 2  # nor does the finished slowest one: 8 - 7
    assert request_progress([5, 6], [7, 9], [True, True]) == 5  # the request's last round: every token


def test_probes_judge_speculation_by_what_it_does_for_a_request_end():
    """Summed over rounds, the credits add up to n times the slowest sample's progress: a round kind whose extra
    tokens all go to samples that are already ahead measures no faster than plain rounds."""
    lengths = [1, 1, 1, 1]
    credited = 0
    for advances in ([3, 1, 2, 1], [1, 4, 1, 2], [2, 1, 1, 3]):
        after = [length + step for length, step in zip(lengths, advances, strict=True)]
        credited += request_progress(lengths, after, [False] * 4)
        lengths = after
    assert credited == 4 * (min(lengths) - 1)
