"""A draft over a subset of the target's vocabulary, served as if it had the whole vocabulary.

A draft's LM head is a large share of its cost when the target's vocabulary is large (49152 x 576 is
28M multiply-adds per token, more than a whole small decoder layer). A draft whose embedding and head
cover only the target's most frequent tokens (FR-Spec, arXiv 2502.14856, does this for EAGLE heads)
keeps most of the agreement at a fraction of the cost. The checkpoint then carries ``token_map.safetensors``:
``draft_to_target[i]`` is the target id of draft row ``i``, or -1 for a catch-all row ("any other
token") that the draft may read but never proposes. The map is applied at the model's edges: target
ids are mapped to draft rows on input (unknown ids to the catch-all row), and the head's logits are
scattered back into the target's vocabulary (-inf elsewhere), so batching, sampling and the lossless
rejection test see an ordinary full-vocabulary draft whose distribution is zero outside the subset.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

TOKEN_MAP_FILE = "token_map.safetensors"
CATCH_ALL = -1


class TokenMapError(ValueError):
    """A token map that does not fit its checkpoint; the message says what is wrong."""


class TokenMap:
    """The draft-row -> target-id table of a subset-vocabulary draft, and its inverse."""

    def __init__(self, draft_to_target: torch.Tensor, target_vocab_size: int) -> None:
        """Validate the table: target ids unique and in [0, target_vocab_size), at most one catch-all row.
        Raises TokenMapError otherwise."""
        table = draft_to_target.to(torch.long).flatten()
        mapped = table[table != CATCH_ALL]
        if bool(((mapped < 0) | (mapped >= target_vocab_size)).any()):
            raise TokenMapError(f"token map has ids outside the target vocabulary [0, {target_vocab_size})")
        if mapped.unique().numel() != mapped.numel():
            raise TokenMapError("token map lists a target id twice")
        catch_all = (table == CATCH_ALL).nonzero().flatten()
        if catch_all.numel() > 1:
            raise TokenMapError("token map has more than one catch-all row")
        self.draft_to_target = table
        self.target_vocab_size = int(target_vocab_size)
        self.catch_all_row = int(catch_all[0]) if catch_all.numel() else None
        self.mapped_rows = (table != CATCH_ALL).nonzero().flatten()
        self.mapped_ids = table[self.mapped_rows]
        fallback = self.catch_all_row if self.catch_all_row is not None else 0
        self.target_to_draft = torch.full((target_vocab_size,), fallback, dtype=torch.long)
        self.target_to_draft[self.mapped_ids] = self.mapped_rows

    @property
    def draft_vocab_size(self) -> int:
        """Rows of the draft's embedding and head."""
        return int(self.draft_to_target.numel())

    def to(self, device: torch.device | str) -> TokenMap:
        """Move the index tensors to ``device`` (in place); returns self."""
        for name in ("draft_to_target", "mapped_rows", "mapped_ids", "target_to_draft"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft rows for target ids of any shape; ids outside the subset read the catch-all row."""
        return self.target_to_draft[target_ids]

    def to_target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Logits [..., draft rows] -> [..., target vocabulary]: each mapped row's logit at its target id,
        -inf at every other id (the catch-all row is dropped: the draft never proposes it)."""
        shape = (*draft_logits.shape[:-1], self.target_vocab_size)
        out = torch.full(shape, float("-inf"), dtype=draft_logits.dtype, device=draft_logits.device)
        out[..., self.mapped_ids] = draft_logits[..., self.mapped_rows]
        return out

    def save(self, directory: str | Path) -> None:
        """Write ``token_map.safetensors`` into a checkpoint directory."""
        save_file({"draft_to_target": self.draft_to_target.cpu().contiguous()}, str(Path(directory) / TOKEN_MAP_FILE),
                  metadata={"target_vocab_size": str(self.target_vocab_size)})


def load_token_map(directory: str | Path, draft_vocab_size: int) -> TokenMap | None:
    """The checkpoint's token map, or None when it has none (a full-vocabulary model).

    Raises TokenMapError when the file is unreadable or its rows do not match the model's vocabulary."""
    path = Path(directory) / TOKEN_MAP_FILE
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        tensors = load_file(str(path))
    except SafetensorError as exc:
        raise TokenMapError(f"{path} is not a readable safetensors file: {exc}") from exc
    if "target_vocab_size" not in metadata:
        raise TokenMapError(f"{path}: metadata 'target_vocab_size' is missing")
    table = tensors.get("draft_to_target")
    if table is None:
        raise TokenMapError(f"{path}: tensor 'draft_to_target' is missing")
    token_map = TokenMap(table, int(metadata["target_vocab_size"]))
    if token_map.draft_vocab_size != draft_vocab_size:
        raise TokenMapError(f"{path}: {token_map.draft_vocab_size} rows, but the model's vocabulary has "
                            f"{draft_vocab_size}")
    return token_map
