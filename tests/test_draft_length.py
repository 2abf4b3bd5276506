"""The adaptive draft-length rule."""

from __future__ import annotations

import pytest

from coordinator.draft_length import DraftLength
from coordinator.speculation_gate import SpeculationGate


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


def run_rounds(gate: SpeculationGate, rounds: int, speculative_rate: float, plain_rate: float,
               sampled: bool = False) -> str:
    """Run ``rounds`` rounds at the given tokens per second of each kind; returns the kinds run, one letter
    per round: S speculative, p plain."""
    kinds = ""
    for _ in range(rounds):
        speculative = gate.speculate(sampled)
        kinds += "S" if speculative else "p"
        gate.record(speculative, 8, 8 / (speculative_rate if speculative else plain_rate), sampled)
    return kinds


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


def test_draft_length_with_a_gate_proposes_nothing_in_plain_rounds():
    gate = SpeculationGate(probe_every=2)
    rule = DraftLength(3, 8, gate=gate)
    assert rule.for_round() == 3
    rule.update(3, [3, 3], seconds=1.0)  # k grows to 4 ...
    assert rule.for_round() == 0  # ... but this round probes plain decoding
    assert rule.update(0, [0, 0], seconds=0.1) == 4  # a plain round leaves k alone
    assert gate.rate() == {True: 8.0, False: 20.0}
    assert DraftLength(3, 8).for_round() == 3  # no gate: always k


def test_gate_keeps_greedy_and_sampled_batches_apart():
    """Speculation that loses on sampled batches does not stop it on greedy ones, and the other way round."""
    gate = SpeculationGate(probe_every=4)
    for _ in range(8):  # sampled batches: speculation at half the plain rate
        speculative = gate.speculate(sampled=True)
        gate.record(speculative, 8, 8 / (50.0 if speculative else 100.0), sampled=True)
    assert not gate.better(sampled=True)
    assert gate.better(sampled=False) and gate.speculate(sampled=False)
    assert gate.rate(sampled=False) == {True: None, False: None}
    # greedy batches: speculation twice as fast, probed as a fresh gate would
    assert run_rounds(gate, 8, speculative_rate=200.0, plain_rate=100.0, sampled=False) == "SpSpSSSS"
    assert not gate.better(sampled=True)  # the sampled figures are untouched


def test_gate_measures_both_kinds_in_its_first_rounds():
    """The second round runs the kind not measured yet (plain), so a losing speculation stops at round 3
    rather than at the first probe; a kind whose round gave no figure is tried again."""
    gate = SpeculationGate(probe_every=16)
    assert run_rounds(gate, 4, speculative_rate=50.0, plain_rate=100.0) == "Sppp"
    fresh = SpeculationGate(probe_every=16)
    assert fresh.speculate()
    fresh.record(True, 0, 1.0)  # a speculative round that emitted nothing: still unmeasured
    assert fresh.speculate()


def test_reset_forgets_the_figures_and_the_grown_k():
    gate = SpeculationGate(probe_every=2)
    rule = DraftLength(3, 8, gate=gate)
    rule.update(3, [3, 3], seconds=1.0)
    rule.update(0, [0, 0], seconds=0.01)  # plain rounds far faster: the gate would stop speculating
    assert rule.k == 4 and not gate.better()
    rule.reset()
    assert rule.k == 3 and gate.rate() == {True: None, False: None}
    assert rule.for_round() == 3  # the first round of the fresh batch speculates again


def test_sampled_mode_gates_sampled_batches_and_always_speculates_for_greedy_ones():
    """The default mode: plain rounds that win stop speculation on sampled batches only."""
    gate = SpeculationGate.for_mode("sampled", probe_every=4)
    assert run_rounds(gate, 8, speculative_rate=50.0, plain_rate=100.0) == "S" * 8  # greedy: not judged
    assert gate.rate(sampled=False) == {True: None, False: None}
    assert run_rounds(gate, 8, speculative_rate=50.0, plain_rate=100.0, sampled=True) == "SppSpppp"
    everywhere = SpeculationGate.for_mode("on", probe_every=4)
    assert run_rounds(everywhere, 8, speculative_rate=50.0, plain_rate=100.0) == "SppSpppp"
    assert SpeculationGate.for_mode("off") is None


def test_gate_rejects_bad_settings():
    with pytest.raises(ValueError, match="probe_every"):
        SpeculationGate(probe_every=1)
    with pytest.raises(ValueError, match="smoothing"):
        SpeculationGate(smoothing=0.0)
    with pytest.raises(ValueError, match="mode"):
        SpeculationGate.for_mode("greedy")


def test_proposals_cut_short_by_the_draft_do_not_count():
    """With per-sequence proposal lengths only the sequences that reached the cap say whether it binds."""
    rule = DraftLength(4, 8)
    assert rule.update(4, [4, 4, 0, 1, 2], lengths=[4, 4, 0, 1, 2]) == 5  # both capped ones took all: grow
    assert rule.update(5, [1, 0, 5, 2], lengths=[1, 5, 5, 5]) == 5  # one of three capped took all: hold
    assert rule.update(5, [0, 1, 0, 0], lengths=[5, 5, 5, 2]) == 4  # none of three capped did: shrink
    assert rule.update(4, [1, 2], lengths=[1, 2]) == 4  # none reached the cap: it did not bind
