"""KV-cache layouts for a batch of groups (one prompt, n samples each).

Rows of a batch are sequences, ordered so the rows of one group are contiguous. Both layouts expose
the same operations, so the runtime can compare them in one run:

- ``BifurcatedKV``: each group's prompt KV is stored once (packed with the other groups' prefixes);
  each row has its own decode KV. Memory grows as prompt_len + n * decode_len. With a prefix cache, the
  cached head of a group's prompt stays in the cache (``engine.prefix_cache``), read in place by every
  group whose path includes it: three levels (shared spans, the group's own prompt tail, decode).
- ``ExpandedKV``: every row holds its own copy of the prompt KV followed by its decode KV, as naive
  batching does. Memory grows as n * (prompt_len + decode_len).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.prefix_cache import PrefixSpan
from kernels.cascade import CascadeFn, ContextLevel, contiguous_runs
from kernels.standard import standard_attention

BifurcatedFn = Callable[..., torch.Tensor]

ATTENTION_LAYOUTS = ("bifurcated", "standard")


class KVLayout(ABC):
    """Per-layer KV storage of a batch, with decode lengths tracked by the caller (``base``/``lens``).

    All tensors live on ``device``. A step first calls ``reserve`` with host-side positions (it may grow
    the slabs), then ``write``/``attend`` per layer, which only launch device work: no host
    synchronisation, so a step can be captured in a CUDA graph. ``version`` changes whenever a cache
    tensor is replaced (groups added or dropped, capacity grown); a graph is valid while it lasts.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.group_sizes: list[int] = []
        self.prefix_lens: list[int] = []  # each group's whole prompt length (its rows' first decode position)
        self.stored_lens: list[int] = []  # the part of it this layout stores (the rest is in shared spans)
        self.group_spans: list[PrefixSpan | None] = []  # deepest cached span of each group's prompt
        self.version = 0
        self._row_prefix_lens: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        """Number of sequences (rows) in the batch."""
        return sum(self.group_sizes)

    def row_prefix_lens_list(self) -> list[int]:
        """Prompt length of each row's group, as host ints."""
        return [p for p, n in zip(self.prefix_lens, self.group_sizes, strict=True) for _ in range(n)]

    def row_prefix_lens(self) -> torch.Tensor:
        """[B] prompt length of each row's group on the layout's device (one tensor per version)."""
        if self._row_prefix_lens is None:
            self._row_prefix_lens = torch.tensor(self.row_prefix_lens_list(), dtype=torch.long, device=self.device)
        return self._row_prefix_lens

    def _changed(self) -> None:
        """Record that cache tensors or the group structure were replaced."""
        self.version += 1
        self._row_prefix_lens = None

    def shared_changed(self) -> None:
        """Record that shared prefix spans were restructured (split) by their cache."""
        self._changed()

    def reserve(self, base: Sequence[int], width: int) -> None:
        """Make room for a window of ``width`` tokens at decode positions base[b] .. base[b] + width - 1 of
        every row (the slabs grow by doubling, which bumps ``version``)."""
        if base:
            self._ensure_capacity(self._slots_needed(base, width))

    @abstractmethod
    def _slots_needed(self, base: Sequence[int], width: int) -> int:
        """Slab slots along the position dimension that a window at decode positions ``base`` needs."""

    @abstractmethod
    def _ensure_capacity(self, capacity: int) -> None:
        """Grow the slabs (keeping their contents) to at least ``capacity`` position slots."""

    @abstractmethod
    def add_group(self, rows: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                  shared: PrefixSpan | None = None) -> int:
        """Add a group of ``rows`` samples whose prompt is the cached path ending at ``shared`` (None:
        nothing cached) followed by tokens whose KV per layer is keys/values [Hkv, P, D] (P may be 0 only
        after a shared path). Returns the group's first row; the rows after it move down by ``rows``."""

    def _insert_group(self, index: int, rows: int, prompt_len: int, stored_len: int,
                      shared: PrefixSpan | None) -> None:
        self.group_sizes.insert(index, rows)
        self.prefix_lens.insert(index, prompt_len)
        self.stored_lens.insert(index, stored_len)
        self.group_spans.insert(index, shared)
        self._changed()

    @abstractmethod
    def keep_rows(self, keep: Sequence[bool]) -> None:
        """Drop the rows whose flag is False; groups left without rows are dropped with their prompt KV."""

    @abstractmethod
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, base: torch.Tensor) -> None:
        """Store the window's k, v [B, Hkv, W, D] at decode positions base[b] .. base[b] + W - 1 (``reserve``
        must have made room for them)."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, base: torch.Tensor, lens: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Attention of q [B, Hq, W, D]: query i of row b sees its whole prompt and decode keys
        j < min(base[b] + i + 1, lens[b]). Returns [B, Hq, W, D]."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held by the cache tensors."""

    def _regroup(self, keep: Sequence[bool]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Keep the flagged rows' groups: updates group sizes and prompt lengths, returns (kept row
        indices on the device, [start, end) of each kept group's prompt within the old packed prompts)."""
        sizes, lens, stored, shared, spans, start, offset = [], [], [], [], [], 0, 0
        for size, plen, slen, span in zip(self.group_sizes, self.prefix_lens, self.stored_lens, self.group_spans,
                                          strict=True):
            kept = sum(keep[start : start + size])
            if kept:
                sizes.append(kept)
                lens.append(plen)
                stored.append(slen)
                shared.append(span)
                spans.append((offset, offset + slen))
            start += size
            offset += slen
        self.group_sizes, self.prefix_lens, self.stored_lens, self.group_spans = sizes, lens, stored, shared
        self._changed()
        kept_rows = [i for i, flag in enumerate(keep) if flag]
        return torch.tensor(kept_rows, dtype=torch.long, device=self.device), spans

    def _grown(self, slab: torch.Tensor, capacity: int) -> torch.Tensor:
        """slab [B, H, C, D] itself when C >= ``capacity``, else a copy with capacity >= ``capacity``
        (doubling; the layout's version is bumped)."""
        if slab.shape[2] >= capacity:
            return slab
        new_capacity = max(capacity, 2 * slab.shape[2], 16)
        grown = slab.new_zeros(slab.shape[0], slab.shape[1], new_capacity, slab.shape[3])
        grown[:, :, : slab.shape[2]] = slab
        self._changed()
        return grown

    @staticmethod
    def _scatter(slab: torch.Tensor, x: torch.Tensor, positions: torch.Tensor) -> None:
        """slab[b, :, positions[b, i]] = x[b, :, i] for x [B, H, W, D] and positions [B, W]."""
        rows = torch.arange(slab.shape[0], device=slab.device)[:, None].expand_as(positions)
        slab[rows, :, positions] = x.permute(0, 2, 1, 3).to(slab.dtype)

    def _window_positions(self, base: torch.Tensor, width: int) -> torch.Tensor:
        """[B, W] decode positions base[b] + i of a window of ``width`` tokens."""
        return base[:, None] + torch.arange(width, device=base.device)[None, :]

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=self.dtype, device=self.device)


class BifurcatedKV(KVLayout):
    """Prompt KV stored once per group, decode KV per row; attention split and merged by LSE.

    ``attention`` is the two-level (prefix, decode) kernel; ``cascade`` the many-level one of the same backend,
    which attends when groups have shared spans from a prefix cache.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 attention: BifurcatedFn, device: torch.device | str = "cpu",
                 cascade: CascadeFn | None = None) -> None:
        super().__init__(num_layers, kv_heads, head_dim, dtype, device)
        self._attention = attention
        self._cascade = cascade
        self._plan: _CascadePlan | None = None
        self._plan_version = -1
        self.prefix_k = [self._zeros(kv_heads, 0, head_dim) for _ in range(num_layers)]
        self.prefix_v = [self._zeros(kv_heads, 0, head_dim) for _ in range(num_layers)]
        self.decode_k = [self._zeros(0, kv_heads, 0, head_dim) for _ in range(num_layers)]
        self.decode_v = [self._zeros(0, kv_heads, 0, head_dim) for _ in range(num_layers)]

    def add_group(self, rows: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                  shared: PrefixSpan | None = None) -> int:
        """As ``KVLayout.add_group``; a group with a cached path goes right after the last group that reads
        the deepest span of it (``_placement``), so each span is read by one contiguous run of rows."""
        stored = int(keys[0].shape[1])
        if shared is not None and self._cascade is None:
            raise ValueError("shared prefix spans need the layout's cascade attention")
        if shared is None and stored == 0:
            raise ValueError("a group needs a non-empty prompt")
        index = self._placement(shared)
        row, offset = sum(self.group_sizes[:index]), sum(self.stored_lens[:index])
        for layer in range(self.num_layers):
            self.prefix_k[layer] = _inserted(self.prefix_k[layer], keys[layer], offset, dim=1)
            self.prefix_v[layer] = _inserted(self.prefix_v[layer], values[layer], offset, dim=1)
            fresh = self._zeros(rows, self.kv_heads, self.decode_k[layer].shape[2], self.head_dim)
            self.decode_k[layer] = _inserted(self.decode_k[layer], fresh, row, dim=0)
            self.decode_v[layer] = _inserted(self.decode_v[layer], fresh, row, dim=0)
        self._insert_group(index, rows, stored + (shared.end() if shared is not None else 0), stored, shared)
        return row

    def _placement(self, shared: PrefixSpan | None) -> int:
        """Where a group whose cached path ends at ``shared`` goes among the groups: after the last one whose
        path holds the deepest span it shares with ``shared``'s path, else at the end. Groups then stay in
        the depth-first order of the prefix tree, where the readers of every span are contiguous (one
        context read per span and layer, not one per run of readers)."""
        if shared is not None:
            paths = [set(span.path()) if span is not None else set() for span in self.group_spans]
            for node in reversed(shared.path()):
                readers = [index for index, path in enumerate(paths) if node in path]
                if readers:
                    return readers[-1] + 1
        return len(self.group_sizes)

    def keep_rows(self, keep: Sequence[bool]) -> None:
        row_index, spans = self._regroup(keep)
        prefix_index = torch.tensor([i for lo, hi in spans for i in range(lo, hi)], dtype=torch.long,
                                    device=self.device)
        for layer in range(self.num_layers):
            self.prefix_k[layer] = self.prefix_k[layer][:, prefix_index]
            self.prefix_v[layer] = self.prefix_v[layer][:, prefix_index]
            self.decode_k[layer] = self.decode_k[layer][row_index]
            self.decode_v[layer] = self.decode_v[layer][row_index]

    def _slots_needed(self, base: Sequence[int], width: int) -> int:
        return max(base) + width

    def _ensure_capacity(self, capacity: int) -> None:
        for layer in range(self.num_layers):
            self.decode_k[layer] = self._grown(self.decode_k[layer], capacity)
            self.decode_v[layer] = self._grown(self.decode_v[layer], capacity)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, base: torch.Tensor) -> None:
        positions = self._window_positions(base, k.shape[2])
        self._scatter(self.decode_k[layer], k, positions)
        self._scatter(self.decode_v[layer], v, positions)

    def attend(self, layer: int, q: torch.Tensor, base: torch.Tensor, lens: torch.Tensor,
               scale: float) -> torch.Tensor:
        plan = self._cascade_plan()
        if plan.spans:
            assert self._cascade is not None
            levels = [ContextLevel(self.prefix_k[layer][:, lo:hi], self.prefix_v[layer][:, lo:hi], offsets, groups,
                                   row_lo) for lo, hi, offsets, groups, row_lo in plan.own]
            levels += [ContextLevel(span.keys[layer], span.values[layer], (0, len(span.tokens)), (0, hi - lo), lo)
                       for span, lo, hi in plan.spans]
            return self._cascade(q, levels, self.decode_k[layer], self.decode_v[layer], base, lens, scale)
        (_, _, offsets, groups, _), = plan.own
        return self._attention(
            q, self.prefix_k[layer], self.prefix_v[layer], list(offsets), list(groups),
            self.decode_k[layer], self.decode_v[layer], base, lens, scale,
        )

    def _cascade_plan(self) -> _CascadePlan:
        """Which rows attend which stored prompt runs and shared spans (rebuilt once per version)."""
        if self._plan is not None and self._plan_version == self.version:
            return self._plan
        own: list[tuple[int, int, tuple[int, ...], tuple[int, ...], int]] = []
        users: dict[PrefixSpan, list[int]] = {}
        row = stored = 0
        run: list[tuple[int, int]] = []  # (stored length, rows) of consecutive groups that store a prompt tail

        def close_run() -> None:
            if run:
                size = sum(n for _, n in run)
                offsets, groups = [0], [0]
                for slen, n in run:
                    offsets.append(offsets[-1] + slen)
                    groups.append(groups[-1] + n)
                own.append((stored - offsets[-1], stored, tuple(offsets), tuple(groups), row - size))
                run.clear()

        for size, slen, span in zip(self.group_sizes, self.stored_lens, self.group_spans, strict=True):
            if slen:
                run.append((slen, size))
            else:
                close_run()
            for node in span.path() if span is not None else ():
                users.setdefault(node, []).extend(range(row, row + size))
            row += size
            stored += slen
        close_run()
        spans = [(node, lo, hi) for node, rows in users.items() for lo, hi in contiguous_runs(rows)]
        self._plan, self._plan_version = _CascadePlan(own, spans), self.version
        return self._plan

    def nbytes(self) -> int:
        tensors = self.prefix_k + self.prefix_v + self.decode_k + self.decode_v
        return sum(t.numel() * t.element_size() for t in tensors)


def _inserted(tensor: torch.Tensor, part: torch.Tensor, at: int, dim: int) -> torch.Tensor:
    """``tensor`` with ``part`` (cast to its dtype and device) inserted before index ``at`` along ``dim``."""
    head, tail = tensor.split([at, tensor.shape[dim] - at], dim=dim)
    return torch.cat([head, part.to(tensor), tail], dim=dim)


@dataclass
class _CascadePlan:
    """Per version: runs of groups with stored prompt tails (stored [lo, hi), segment offsets, row offsets,
    first row) and the shared spans with the contiguous row run [lo, hi) that reads each."""

    own: list[tuple[int, int, tuple[int, ...], tuple[int, ...], int]]
    spans: list[tuple[PrefixSpan, int, int]]


class ExpandedKV(KVLayout):
    """Every row holds a private copy of its prompt KV followed by its decode KV (the baseline)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(num_layers, kv_heads, head_dim, dtype, device)
        self.k = [self._zeros(0, kv_heads, 0, head_dim) for _ in range(num_layers)]
        self.v = [self._zeros(0, kv_heads, 0, head_dim) for _ in range(num_layers)]

    def add_group(self, rows: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                  shared: PrefixSpan | None = None) -> int:
        """As ``KVLayout.add_group``; the group's rows go last (each holds a copy of its whole prompt)."""
        first_row = self.rows
        path = shared.path() if shared is not None else []
        plen = int(keys[0].shape[1]) + sum(len(s.tokens) for s in path)
        self._ensure_capacity(plen)
        for layer in range(self.num_layers):
            fresh_k = self._zeros(rows, self.kv_heads, self.k[layer].shape[2], self.head_dim)
            fresh_v = torch.zeros_like(fresh_k)
            fresh_k[:, :, :plen] = torch.cat([s.keys[layer] for s in path] + [keys[layer]], dim=1).to(fresh_k)
            fresh_v[:, :, :plen] = torch.cat([s.values[layer] for s in path] + [values[layer]], dim=1).to(fresh_v)
            self.k[layer] = torch.cat([self.k[layer], fresh_k])
            self.v[layer] = torch.cat([self.v[layer], fresh_v])
        self._insert_group(len(self.group_sizes), rows, plen, plen, None)  # every row copies its whole prompt
        return first_row

    def keep_rows(self, keep: Sequence[bool]) -> None:
        row_index, _ = self._regroup(keep)
        for layer in range(self.num_layers):
            self.k[layer] = self.k[layer][row_index]
            self.v[layer] = self.v[layer][row_index]

    def _slots_needed(self, base: Sequence[int], width: int) -> int:
        return max(p + b for p, b in zip(self.row_prefix_lens_list(), base, strict=True)) + width

    def _ensure_capacity(self, capacity: int) -> None:
        for layer in range(self.num_layers):
            self.k[layer] = self._grown(self.k[layer], capacity)
            self.v[layer] = self._grown(self.v[layer], capacity)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, base: torch.Tensor) -> None:
        positions = self._window_positions(self.row_prefix_lens() + base, k.shape[2])
        self._scatter(self.k[layer], k, positions)
        self._scatter(self.v[layer], v, positions)

    def attend(self, layer: int, q: torch.Tensor, base: torch.Tensor, lens: torch.Tensor,
               scale: float) -> torch.Tensor:
        plens = self.row_prefix_lens()
        return standard_attention(q, self.k[layer], self.v[layer], plens + base, plens + lens, scale)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
