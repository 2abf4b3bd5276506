"""Cascade attention over several context levels plus per-row decode KV, merged exactly by log-sum-exp.

Hydragen's tree: a system prompt shared by many requests, each request's own prompt, each sample's own
decode tokens. Every level is a set of KV segments, each attended by a contiguous run of rows (its M
dimension folds those rows, their GQA query heads and the window), so shared KV is read once per step
for all the rows below it. The parts are combined with the running merge

    lse = log(e^lse_a + e^lse_b),  o = (e^lse_a o_a + e^lse_b o_b) / e^lse

which is exact in any order. A level's part is computed by the backend's context function (PyTorch or
Triton), the decode part by its decode function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels.bifurcated import merge_states

ContextFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
DecodeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class ContextLevel:
    """KV segments [Hkv, P, D] (packed along P) attended by rows ``row_lo:row_hi``: segment g covers
    ``k[:, prefix_offsets[g]:prefix_offsets[g+1]]`` for rows ``row_lo + group_offsets[g]`` up to
    ``row_lo + group_offsets[g+1]`` (every segment non-empty)."""

    k: torch.Tensor
    v: torch.Tensor
    prefix_offsets: tuple[int, ...]
    group_offsets: tuple[int, ...]
    row_lo: int

    @property
    def row_hi(self) -> int:
        """One past the last row this level reaches."""
        return self.row_lo + self.group_offsets[-1]


def cascade_attention(q: torch.Tensor, levels: Sequence[ContextLevel], decode_k: torch.Tensor,
                      decode_v: torch.Tensor, decode_base: torch.Tensor, decode_lens: torch.Tensor, scale: float,
                      context: ContextFn, decode: DecodeFn) -> torch.Tensor:
    """Attention of q [B, Hq, W, D] over every level reaching its row plus its own decode keys
    ``j < min(decode_base[b] + i + 1, decode_lens[b])``. Equal (up to rounding) to softmax attention over
    the concatenation of those keys; no level is copied per row. Returns [B, Hq, W, D] in q's dtype."""
    o, lse = decode(q, decode_k, decode_v, decode_base, decode_lens, scale)
    for level in levels:
        lo, hi = level.row_lo, level.row_hi
        o_level, lse_level = context(q[lo:hi], level.k, level.v, list(level.prefix_offsets),
                                     list(level.group_offsets), scale)
        o[lo:hi], lse[lo:hi] = merge_states(o[lo:hi], lse[lo:hi], o_level, lse_level)
    return o.to(q.dtype)


def contiguous_runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """[lo, hi) runs of consecutive row indices in the sorted ``rows``."""
    runs: list[tuple[int, int]] = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs
