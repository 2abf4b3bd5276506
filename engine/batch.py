"""A batch held by a model service between rounds: its groups, sequences and KV cache."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from engine.errors import InvalidInput
from engine.kv_cache import KVLayout
from engine.prefix_cache import PrefixSpan
from engine.prompt_lookup import PromptLookup
from engine.sampling import SamplingParams


@dataclass
class SequenceState:
    """One sample's position in the batch.

    ``decoded`` tokens after the prompt are in the KV cache; ``pending`` tokens are accepted but not
    yet cached (they open the next window). The draft also remembers its last ``proposed`` tokens, of
    which all but the last were cached while proposing, and, with prompt lookup on, every confirmed token
    (``lookup``).
    """

    sequence_id: int
    group_id: int
    params: SamplingParams
    generator: torch.Generator
    decoded: int = 0
    pending: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    lookup: PromptLookup | None = None
    logprobs: bool = False  # the target reports the log-probability of each token it confirms


@dataclass
class GroupInput:
    """A group to prefill: one prompt shared by the listed sequences (sample i = sequence_ids[i])."""

    group_id: int
    prompt_token_ids: list[int]
    sequence_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    logprobs: bool = False  # target: report each emitted token's log-probability


class Batch:
    """Sequences in row order (a group's rows contiguous) and the KV layout that holds their cache."""

    def __init__(self, batch_id: str, kv: KVLayout) -> None:
        self.batch_id = batch_id
        self.kv = kv
        self.sequences: list[SequenceState] = []
        self.last_used = time.monotonic()

    def touch(self) -> None:
        """Mark the batch as used now (it expires after the service's idle TTL)."""
        self.last_used = time.monotonic()

    def ids(self) -> set[int]:
        """The live sequence ids."""
        return {s.sequence_id for s in self.sequences}

    def add(self, states: Sequence[SequenceState], keys: list[torch.Tensor], values: list[torch.Tensor],
            shared: PrefixSpan | None = None) -> None:
        """Add one group's sequences (rows) with its prompt KV: the cached path ending at ``shared``, then
        keys/values of the rest of the prompt. The rows go where the layout puts them (last, or next to the
        groups that share their cached prefix); a group's rows stay contiguous."""
        first_row = self.kv.add_group(len(states), keys, values, shared)
        self.sequences[first_row:first_row] = states

    def release(self, sequence_ids: Iterable[int]) -> int:
        """Drop the given sequences and their KV; unknown ids are ignored. Returns how many were dropped."""
        drop = set(sequence_ids)
        keep = [s.sequence_id not in drop for s in self.sequences]
        if all(keep):
            return 0
        self.kv.keep_rows(keep)
        self.sequences = [s for s, flag in zip(self.sequences, keep, strict=True) if flag]
        return keep.count(False)

    def in_row_order(self, by_id: dict[int, object], what: str) -> list:
        """Entries of ``by_id`` in row order; every live sequence must appear exactly once."""
        live = self.ids()
        unknown = set(by_id) - live
        missing = live - set(by_id)
        if unknown or missing:
            raise InvalidInput(
                f"{what} must list every live sequence of batch {self.batch_id} once: "
                f"unknown {sorted(unknown)[:8]}, missing {sorted(missing)[:8]}"
            )
        return [by_id[s.sequence_id] for s in self.sequences]

    def decoded(self) -> torch.Tensor:
        """[B] cached decode tokens per row."""
        return torch.tensor([s.decoded for s in self.sequences], dtype=torch.long)


def pad_windows(windows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ragged token windows into ([B, W] tokens, [B] widths)."""
    width = max((len(w) for w in windows), default=0)
    tokens = torch.zeros(len(windows), max(width, 1), dtype=torch.long)
    for row, window in enumerate(windows):
        tokens[row, : len(window)] = torch.tensor(list(window), dtype=torch.long)
    return tokens, torch.tensor([len(w) for w in windows], dtype=torch.long)
