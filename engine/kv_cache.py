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
    """Per-layer KV storage of a batch, with decode lengths tracked by the caller (``base``/``lens``)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.group_sizes: list[int] = []
        self.prefix_lens: list[int] = []

    @property
    def rows(self) -> int:
        """Number of sequences (rows) in the batch."""
        return sum(self.group_sizes)

    def row_prefix_lens(self) -> torch.Tensor:
        """[B] prompt length of each row's group."""
        return torch.tensor(
            [p for p, n in zip(self.prefix_lens, self.group_sizes, strict=True) for _ in range(n)],
            dtype=torch.long,
        )

    @abstractmethod
    def add_group(self, rows: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Append a group of ``rows`` samples whose prompt KV per layer is keys/values [Hkv, P, D]."""

    @abstractmethod
    def keep_rows(self, keep: Sequence[bool]) -> None:
        """Drop the rows whose flag is False; groups left without rows are dropped with their prompt KV."""

    @abstractmethod
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, base: torch.Tensor) -> None:
        """Store the window's k, v [B, Hkv, W, D] at decode positions base[b] .. base[b] + W - 1."""

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
        indices, [start, end) of each kept group's prompt within the old packed prompts)."""
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
        return torch.tensor([i for i, flag in enumerate(keep) if flag], dtype=torch.long), spans

    @staticmethod
    def _grow(slab: torch.Tensor, capacity: int) -> torch.Tensor:
        """A copy of slab [B, H, C, D] with capacity >= ``capacity`` along dim 2 (doubling)."""
        if slab.shape[2] >= capacity:
            return slab
        new_capacity = max(capacity, 2 * slab.shape[2], 16)
        grown = slab.new_zeros(slab.shape[0], slab.shape[1], new_capacity, slab.shape[3])
        grown[:, :, : slab.shape[2]] = slab
        return grown

    @staticmethod
    def _scatter(slab: torch.Tensor, x: torch.Tensor, positions: torch.Tensor) -> None:
        """slab[b, :, positions[b, i]] = x[b, :, i] for x [B, H, W, D] and positions [B, W]."""
        rows = torch.arange(slab.shape[0])[:, None].expand_as(positions)
        slab[rows, :, positions] = x.permute(0, 2, 1, 3).to(slab.dtype)

    def _empty_slab(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows, self.kv_heads, 0, self.head_dim, dtype=self.dtype)


class BifurcatedKV(KVLayout):
    """Prompt KV stored once per group, decode KV per row; attention split and merged by LSE."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 attention: BifurcatedFn) -> None:
        super().__init__(num_layers, kv_heads, head_dim, dtype)
        self._attention = attention
        self.prefix_k = [torch.zeros(kv_heads, 0, head_dim, dtype=dtype) for _ in range(num_layers)]
        self.prefix_v = [torch.zeros(kv_heads, 0, head_dim, dtype=dtype) for _ in range(num_layers)]
        self.decode_k = [self._empty_slab(0) for _ in range(num_layers)]
        self.decode_v = [self._empty_slab(0) for _ in range(num_layers)]

    def add_group(self, rows: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        for layer in range(self.num_layers):
            self.prefix_k[layer] = torch.cat([self.prefix_k[layer], keys[layer].to(self.dtype)], dim=1)
            self.prefix_v[layer] = torch.cat([self.prefix_v[layer], values[layer].to(self.dtype)], dim=1)
            capacity = self.decode_k[layer].shape[2]
            fresh = torch.zeros(rows, self.kv_heads, capacity, self.head_dim, dtype=self.dtype)
            self.decode_k[layer] = torch.cat([self.decode_k[layer], fresh])
            self.decode_v[layer] = torch.cat([self.decode_v[layer], fresh.clone()])
        self.group_sizes.append(rows)
        self.prefix_lens.append(int(keys[0].shape[1]))

    def keep_rows(self, keep: Sequence[bool]) -> None:
        row_index, spans = self._regroup(keep)
        prefix_index = torch.cat([torch.arange(lo, hi) for lo, hi in spans] or [torch.zeros(0, dtype=torch.long)])
        for layer in range(self.num_layers):
            self.prefix_k[layer] = self.prefix_k[layer][:, prefix_index]
            self.prefix_v[layer] = self.prefix_v[layer][:, prefix_index]
            self.decode_k[layer] = self.decode_k[layer][row_index]
            self.decode_v[layer] = self.decode_v[layer][row_index]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, base: torch.Tensor) -> None:
        positions = base[:, None] + torch.arange(k.shape[2])[None, :]
        end = int(positions.max()) + 1 if positions.numel() else 0
        self.decode_k[layer] = self._grow(self.decode_k[layer], end)
        self.decode_v[layer] = self._grow(self.decode_v[layer], end)
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

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__(num_layers, kv_heads, head_dim, dtype)
        self.k = [self._empty_slab(0) for _ in range(num_layers)]
        self.v = [self._empty_slab(0) for _ in range(num_layers)]

    def add_group(self, rows: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        plen = int(keys[0].shape[1])
        for layer in range(self.num_layers):
            capacity = max(self.k[layer].shape[2], plen)
            self.k[layer] = self._grow(self.k[layer], capacity)
            self.v[layer] = self._grow(self.v[layer], capacity)
            fresh_k = torch.zeros(rows, self.kv_heads, self.k[layer].shape[2], self.head_dim, dtype=self.dtype)
            fresh_v = torch.zeros_like(fresh_k)
            fresh_k[:, :, :plen] = keys[layer].to(self.dtype)
            fresh_v[:, :, :plen] = values[layer].to(self.dtype)
            self.k[layer] = torch.cat([self.k[layer], fresh_k])
            self.v[layer] = torch.cat([self.v[layer], fresh_v])
        self.group_sizes.append(rows)
        self.prefix_lens.append(plen)

    def keep_rows(self, keep: Sequence[bool]) -> None:
        row_index, _ = self._regroup(keep)
        for layer in range(self.num_layers):
            self.k[layer] = self.k[layer][row_index]
            self.v[layer] = self.v[layer][row_index]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, base: torch.Tensor) -> None:
        positions = self.row_prefix_lens()[:, None] + base[:, None] + torch.arange(k.shape[2])[None, :]
        end = int(positions.max()) + 1 if positions.numel() else 0
        self.k[layer] = self._grow(self.k[layer], end)
        self.v[layer] = self._grow(self.v[layer], end)
        self._scatter(self.k[layer], k, positions)
        self._scatter(self.v[layer], v, positions)

    def attend(self, layer: int, q: torch.Tensor, base: torch.Tensor, lens: torch.Tensor,
               scale: float) -> torch.Tensor:
        plens = self.row_prefix_lens()
        return standard_attention(q, self.k[layer], self.v[layer], plens + base, plens + lens, scale)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
