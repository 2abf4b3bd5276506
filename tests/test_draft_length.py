"""The adaptive draft-length rule."""

from __future__ import annotations

import pytest

from coordinator.draft_length import DraftLength


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
