"""KV-cache layouts for a batch of groups (one prompt, n samples each).

Rows of a batch are sequences, ordered so the rows of one group are contiguous. Both layouts expose
the same operations, so the runtime can compare them in one run:

- ``BifurcatedKV``: each group's prompt KV is stored once (packed with the other groups' prefixes);
  each row has its own decode KV. Memory grows as prompt_len + n * decode_len.
- ``ExpandedKV``: every row holds its own copy of the prompt KV followed by its decode KV, as naive
  batching does. Memory grows as n * (prompt_len + decode_len).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

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
        self.prefix_lens: list[int] = []
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
    def add_group(self, rows: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Append a group of ``rows`` samples whose prompt KV per layer is keys/values [Hkv, P, D]."""

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
        sizes, lens, spans, start, offset = [], [], [], 0, 0
        for size, plen in zip(self.group_sizes, self.prefix_lens, strict=True):
            kept = sum(keep[start : start + size])
            if kept:
                sizes.append(kept)
                lens.append(plen)
                spans.append((offset, offset + plen))
            start += size
            offset += plen
        self.group_sizes, self.prefix_lens = sizes, lens
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
    """Prompt KV stored once per group, decode KV per row; attention split and merged by LSE."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 attention: BifurcatedFn, device: torch.device | str = "cpu") -> None:
        super().__init__(num_layers, kv_heads, head_dim, dtype, device)
        self._attention = attention
        self.prefix_k = [self._zeros(kv_heads, 0, head_dim) for _ in range(num_layers)]
        self.prefix_v = [self._zeros(kv_heads, 0, head_dim) for _ in range(num_layers)]
        self.decode_k = [self._zeros(0, kv_heads, 0, head_dim) for _ in range(num_layers)]
        self.decode_v = [self._zeros(0, kv_heads, 0, head_dim) for _ in range(num_layers)]

    def add_group(self, rows: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        for layer in range(self.num_layers):
            self.prefix_k[layer] = torch.cat([self.prefix_k[layer], keys[layer].to(self.prefix_k[layer])], dim=1)
            self.prefix_v[layer] = torch.cat([self.prefix_v[layer], values[layer].to(self.prefix_v[layer])], dim=1)
            capacity = self.decode_k[layer].shape[2]
            self.decode_k[layer] = torch.cat([self.decode_k[layer], self._zeros(rows, self.kv_heads, capacity,
                                                                                self.head_dim)])
            self.decode_v[layer] = torch.cat([self.decode_v[layer], self._zeros(rows, self.kv_heads, capacity,
                                                                                self.head_dim)])
        self.group_sizes.append(rows)
        self.prefix_lens.append(int(keys[0].shape[1]))
        self._changed()

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
        prefix_offsets = [0]
        group_offsets = [0]
        for size, plen in zip(self.group_sizes, self.prefix_lens, strict=True):
            prefix_offsets.append(prefix_offsets[-1] + plen)
            group_offsets.append(group_offsets[-1] + size)
        return self._attention(
            q, self.prefix_k[layer], self.prefix_v[layer], prefix_offsets, group_offsets,
            self.decode_k[layer], self.decode_v[layer], base, lens, scale,
        )

    def nbytes(self) -> int:
        tensors = self.prefix_k + self.prefix_v + self.decode_k + self.decode_v
        return sum(t.numel() * t.element_size() for t in tensors)


class ExpandedKV(KVLayout):
    """Every row holds a private copy of its prompt KV followed by its decode KV (the baseline)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(num_layers, kv_heads, head_dim, dtype, device)
        self.k = [self._zeros(0, kv_heads, 0, head_dim) for _ in range(num_layers)]
        self.v = [self._zeros(0, kv_heads, 0, head_dim) for _ in range(num_layers)]

    def add_group(self, rows: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        plen = int(keys[0].shape[1])
        self._ensure_capacity(plen)
        for layer in range(self.num_layers):
            fresh_k = self._zeros(rows, self.kv_heads, self.k[layer].shape[2], self.head_dim)
            fresh_v = torch.zeros_like(fresh_k)
            fresh_k[:, :, :plen] = keys[layer].to(fresh_k)
            fresh_v[:, :, :plen] = values[layer].to(fresh_v)
            self.k[layer] = torch.cat([self.k[layer], fresh_k])
            self.v[layer] = torch.cat([self.v[layer], fresh_v])
        self.group_sizes.append(rows)
        self.prefix_lens.append(plen)
        self._changed()

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
