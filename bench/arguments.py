"""Flag types the benchmarks share."""

from __future__ import annotations

import argparse


def comma_items(text: str) -> list[str]:
    """The non-empty items of a comma-separated flag value, in order, spaces removed."""
    return [item for item in text.replace(" ", "").split(",") if item]


def int_list(text: str, minimum: int = 1) -> list[int]:
    """The integers of a comma-separated flag value (spaces ignored), each at least ``minimum``; raises
    ArgumentTypeError for an empty list, a non-integer or a smaller value."""
    try:
        values = [int(v) for v in comma_items(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < minimum:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers >= {minimum}, got {text!r}")
    return values


def non_negative_int_list(text: str) -> list[int]:
    """``int_list`` with 0 allowed."""
    return int_list(text, minimum=0)
