"""Held-out code prompts for the end-to-end benchmark: Python stdlib functions cut after their docstring.

The held-out split is the one the default models were trained with (``tools/train_default_models.py``,
documented in ``models/README.md``): a stdlib file is held out when ``sha1(relpath) % 20 == 0``. When the
training script is present (a source checkout) its own ``collect_corpus`` and ``make_prompts`` are used;
otherwise (an installed package without ``tools/``) the documented rule is replicated here. Prompts are
deterministic: each is cut right after a ``def ...:`` line and its docstring, at least 2000 characters
into the file, at most two per file, and keeps the last ``max_tokens`` tokens (at least ``min_tokens``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

HOLDOUT_MOD = 20
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
_TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "train_default_models.py"


@dataclass(frozen=True)
class CodePrompt:
    """One prompt: where it was cut (held-out file, line after the docstring) and its token ids."""

    file: str
    line: int
    token_ids: list[int]


def training_script() -> ModuleType | None:
    """The training script as a module (its split/prompt functions), or None when it is not on disk."""
    if not _TRAIN_SCRIPT.is_file():
        return None
    spec = importlib.util.spec_from_file_location("specserve_train_default_models", _TRAIN_SCRIPT)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def is_heldout(relpath: str) -> bool:
    """True iff the stdlib file ``relpath`` (posix, relative to the stdlib dir) is in the held-out split."""
    return int(hashlib.sha1(relpath.encode("utf-8")).hexdigest(), 16) % HOLDOUT_MOD == 0


def heldout_files(stdlib: Path | None = None) -> list[tuple[str, str]]:
    """(relpath, text) of every held-out stdlib file, in sorted relpath order (the training split)."""
    stdlib = Path(stdlib or sysconfig.get_paths()["stdlib"])
    script = training_script()
    if script is not None:
        return list(script.collect_corpus(stdlib)[1])
    paths = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        paths += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    held = []
    for rel, path in sorted((p.relative_to(stdlib).as_posix(), p) for p in paths):
        if not is_heldout(rel):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            held.append((rel, text))
    return held


def _cut_points(text: str, accept: Callable[[int, int], bool], limit: int) -> None:
    """Offer each eligible ``def`` cut (line index after the docstring, char offset) to ``accept`` in file
    order, at most ``limit`` accepted; after an accepted cut the next 40 lines are skipped (as in training)."""
    lines = text.splitlines(keepends=True)
    offs = [0]
    for line in lines:
        offs.append(offs[-1] + len(line))
    taken = 0
    i = 0
    while i < len(lines) and taken < limit:
        stripped = lines[i].lstrip()
        if stripped.startswith("def ") and lines[i].rstrip().endswith(":") and offs[i] > 2000:
            end = i + 1
            if end < len(lines) and lines[end].lstrip().startswith(('"""', "'''", 'r"""')):
                quote = '"""' if '"""' in lines[end] else "'''"
                body = lines[end].strip()
                if not (body.count(quote) >= 2 and len(body) > 6):
                    j = end + 1
                    while j < len(lines) and quote not in lines[j]:
                        j += 1
                    end = j
                end += 1
            if end + 3 < len(lines) and accept(end, offs[min(end, len(lines))]):
                taken += 1
                i = end + 40
                continue
        i += 1


def code_prompts(tokenizer: object, count: int, min_tokens: int = 64, max_tokens: int = 192) -> list[CodePrompt]:
    """``count`` deterministic held-out prompts tokenized with ``tokenizer`` (a HF tokenizer).

    Guarantees: every prompt comes from a held-out file, ends right after a function's signature (and
    docstring, when it has one) and has between ``min_tokens`` and ``max_tokens`` tokens. Raises
    ValueError when fewer than ``count`` prompts exist.
    """
    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]

    held = heldout_files()
    script = training_script()
    prompts: list[CodePrompt] = []
    if script is not None:
        for p in script.make_prompts(tokenizer, held, count, min_tokens, max_tokens):
            prompts.append(CodePrompt(p["file"], int(p["line"]), list(p["ids"])))
    else:
        for rel, text in held:
            def accept(line: int, offset: int, rel: str = rel, text: str = text) -> bool:
                ids = encode(text[:offset])
                if len(ids) < min_tokens:
                    return False
                prompts.append(CodePrompt(rel, line, ids[-max_tokens:]))
                return True

            _cut_points(text, accept, min(2, count - len(prompts)))
            if len(prompts) == count:
                break
    if len(prompts) < count:
        raise ValueError(f"only {len(prompts)} held-out prompts available, {count} requested")
    return prompts[:count]
