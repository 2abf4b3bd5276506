"""Parsing deployment command lines with the specserve CLI's own parser."""

from __future__ import annotations

import io
from contextlib import redirect_stderr
from typing import Any

import pytest

from specserve.cli import build_parser


def parse_cli(argv: list[str], source: str) -> Any:
    """Parse a command line with the specserve CLI; fail naming the flags the CLI does not know."""
    errors = io.StringIO()
    try:
        with redirect_stderr(errors):
            return build_parser().parse_args(argv)
    except SystemExit:
        message = errors.getvalue().strip().splitlines()[-1]
        pytest.fail(f"specserve CLI rejects the command of {source}: {message}\n  argv: {argv}")
