"""Cascade attention over several context levels plus per-row decode KV, merged exactly by log-sum-exp.

Hydragen's tree: a system prompt shared by many requests, each request's own prompt, each sample's own
decode tokens. Every level is a set of KV segments, each attended by a contiguous run of rows (its M
dimension folds those rows, their GQA query heads and the window), so shared KV is read once per step
for all the rows below it. The parts are combined with the running merge

    lse = log(e^lse_a + e^lse_b),  o = (e^lse_a o_a + e^lse_b o_b) / e^lse

which is exact in any order. This is the PyTorch version: a level's part is computed by
``context_attention``, the decode part by ``decode_attention``, and levels that reach disjoint rows (the
per-request branches of one tree depth) form a tier whose parts are merged into the running state in one
step. The Triton version (``kernels.bifurcated_triton.cascade_attention_triton``) needs no merge: one
online softmax per row walks its levels and its decode keys in one launch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels.bifurcated import context_attention, decode_attention, merge_states

CascadeFn = Callable[..., torch.Tensor]  # the signature of cascade_attention


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
                      decode_v: torch.Tensor, decode_base: torch.Tensor, decode_lens: torch.Tensor, scale: float
                      ) -> torch.Tensor:
    """Attention of q [B, Hq, W, D] over every level reaching its row plus its own decode keys
    ``j < min(decode_base[b] + i + 1, decode_lens[b])``. Equal (up to rounding) to softmax attention over
    the concatenation of those keys; no level is copied per row. Returns [B, Hq, W, D] in q's dtype."""
    o, lse = decode_attention(q, decode_k, decode_v, decode_base, decode_lens, scale)
    for tier in disjoint_tiers(levels):
        lo, hi = tier[0].row_lo, tier[-1].row_hi
        if len(tier) == 1:
            o_tier, lse_tier = _context_part(q, tier[0], scale)
        else:  # one merge for the whole tier; rows no level of it reaches get lse = -inf (weight 0)
            o_tier = torch.empty((hi - lo, *q.shape[1:]), dtype=torch.float32, device=q.device)
            lse_tier = torch.empty((hi - lo, *q.shape[1:3]), dtype=torch.float32, device=q.device)
            covered = lo
            for level in tier:
                if level.row_lo > covered:
                    o_tier[covered - lo:level.row_lo - lo] = 0.0
                    lse_tier[covered - lo:level.row_lo - lo] = float("-inf")
                rows = slice(level.row_lo - lo, level.row_hi - lo)
                o_tier[rows], lse_tier[rows] = _context_part(q, level, scale)
                covered = level.row_hi
        o[lo:hi], lse[lo:hi] = merge_states(o[lo:hi], lse[lo:hi], o_tier, lse_tier)
    return o.to(q.dtype)


def _context_part(q: torch.Tensor, level: ContextLevel, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return context_attention(q[level.row_lo:level.row_hi], level.k, level.v, list(level.prefix_offsets),
                   list(level.group_offsets), scale)


def disjoint_tiers(levels: Sequence[ContextLevel]) -> list[list[ContextLevel]]:
    """The levels in tiers, each sorted by row, no two levels of a tier reaching the same row (first fit by
    first row), so a tier is merged into the running state once: a tree of shared spans needs one tier
    per depth, however many requests branch off it."""
    tiers: list[list[ContextLevel]] = []
    for level in sorted(levels, key=lambda lv: (lv.row_lo, -lv.row_hi)):
        tier = next((t for t in tiers if t[-1].row_hi <= level.row_lo), None)
        if tier is None:
            tiers.append([level])
        else:
            tier.append(level)
    return tiers


def contiguous_runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """[lo, hi) runs of consecutive row indices in the sorted ``rows``."""
    runs: list[tuple[int, int]] = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs
