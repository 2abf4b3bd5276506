"""Bifurcated and cascade attention as one Triton kernel (GPU; CPU via ``TRITON_INTERPRET=1``).

Same contracts as :func:`kernels.bifurcated.bifurcated_attention` and :func:`kernels.cascade.cascade_attention`:
``_cascade_kernel`` computes the whole attention of a layer for the ragged batch in one launch.

* The rows are cut into *intervals*, runs of consecutive rows that attend the same chain of context segments
  (a span shared across requests, a group's own prompt tail, ...). Bifurcated attention is the one-level
  case: each group is an interval whose chain is its prompt.
* One program per (tile of ``BLOCK_M`` folded rows of one interval, kv head). The folded rows are the
  interval's samples x the ``r`` query heads sharing the kv head x the ``W`` window positions. The program
  walks its chain, each segment in blocks of ``BLOCK_N`` keys read in place (once per tile, never expanded
  per sample), then folds in the decode keys of each sample of its tile, row by row with the causal-window
  mask ``j < min(decode_base[b] + i + 1, decode_lens[b])``.
* One online softmax covers every part, so nothing is merged and nothing intermediate goes to memory; the
  output is written in ``q``'s dtype. A query that sees no key gets 0.

Segments live in different tensors (the layout's packed prompt tails, each cached span's own KV), so the
kernel reads them through a table of (address, length, strides) made on the host. The table and the tiles
are cached by content (addresses, strides, offsets): a warm step copies nothing to the device, and a step
replayed from a CUDA graph reads the tensors it was captured with (``retain_launch_tensors``).

Under the interpreter the environment variable ``TRITON_INTERPRET=1`` must be set before ``triton`` is
imported (the kernels are decorated at import time).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from itertools import pairwise

import torch
import triton
import triton.language as tl

from kernels import triton_interpreted
from kernels.bifurcated import decode_head_ratio, validate_layout
from kernels.cascade import ContextLevel

__all__ = ["bifurcated_attention_triton", "cascade_attention_triton", "retain_launch_tensors",
           "triton_interpreted"]

_LOG2E = 1.4426950408889634
# One row of the segment table: k address, v address, length, k strides (head, position, dim), v strides.
_SEGMENT_FIELDS = 9


@triton.jit
def _attend_block(q, k, v, visible, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr):
    """One online-softmax step of folded queries q [M, D] over a block of keys/values [N, D]: scores of
    invisible pairs are dropped; returns the updated running (max, sum, accumulator) in the log2 domain."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _load_kv(ptrs, mask, DOT_FP32: tl.constexpr):
    """A block of keys or values, upcast to fp32 where tl.dot runs in fp32."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if DOT_FP32:  # the CPU interpreter's tl.dot is wrong for bf16/fp16 operands (triton 3.9)
        x = x.to(tl.float32)
    return x


@triton.jit
def _attend_keys(q, k_base, v_base, stride_kc, stride_kd, stride_vc, stride_vd, offs_d, d_ok, length,
                 limit, mine, m_i, l_i, acc, qk_scale,
                 BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """Fold the keys ``j < length`` at ``k_base``/``v_base`` into the running state: query m sees key j when
    ``mine[m]`` and ``j < limit[m]`` (the other queries of q see none of them)."""
    for start in range(0, length, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n < length)[:, None] & d_ok[None, :]
        k = _load_kv(k_base + offs_n[:, None] * stride_kc + offs_d[None, :] * stride_kd, kv_mask, DOT_FP32)
        v = _load_kv(v_base + offs_n[:, None] * stride_vc + offs_d[None, :] * stride_vd, kv_mask, DOT_FP32)
        visible = (offs_n[None, :] < limit[:, None]) & mine[:, None]
        m_i, l_i, acc = _attend_block(q, k, v, visible, m_i, l_i, acc, qk_scale, PRECISION)
    return m_i, l_i, acc


@triton.jit
def _cascade_kernel(
    Q, Out, DK, DV, BASE, LENS, SEGMENTS, CHAIN,
    TILE_INTERVAL, TILE_START, CHAIN_OFF, ROW_OFF,
    stride_qb, stride_qh, stride_qw, stride_qd,
    stride_dkb, stride_dkh, stride_dkc, stride_dkd,
    stride_dvb, stride_dvh, stride_dvc, stride_dvd,
    stride_ob, stride_oh, stride_ow,
    qk_scale,
    R: tl.constexpr, W: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, FIELDS: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    interval = tl.load(TILE_INTERVAL + tile)
    m_start = tl.load(TILE_START + tile)
    row_lo = tl.load(ROW_OFF + interval)
    rows = tl.load(ROW_OFF + interval + 1) - row_lo

    offs_m = m_start + tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows * (R * W)
    sample = offs_m // (R * W)
    head = kvh * R + (offs_m // W) % R
    pos = offs_m % W
    row = row_lo + sample
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D

    q_ptrs = (Q + row[:, None] * stride_qb + head[:, None] * stride_qh + pos[:, None] * stride_qw
              + offs_d[None, :] * stride_qd)
    q = _load_kv(q_ptrs, row_ok[:, None] & d_ok[None, :], DOT_FP32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for c in range(tl.load(CHAIN_OFF + interval), tl.load(CHAIN_OFF + interval + 1)):  # the shared context
        seg = SEGMENTS + tl.load(CHAIN + c) * FIELDS
        length = tl.load(seg + 2).to(tl.int32)
        k_base = tl.load(seg).to(tl.pointer_type(DK.dtype.element_ty)) + kvh * tl.load(seg + 3)
        v_base = tl.load(seg + 1).to(tl.pointer_type(DV.dtype.element_ty)) + kvh * tl.load(seg + 6)
        m_i, l_i, acc = _attend_keys(
            q, k_base, v_base, tl.load(seg + 4), tl.load(seg + 5), tl.load(seg + 7), tl.load(seg + 8), offs_d,
            d_ok, length, tl.zeros([BLOCK_M], dtype=tl.int32) + length, row_ok, m_i, l_i, acc, qk_scale,
            BLOCK_N, PRECISION, DOT_FP32)

    last = tl.minimum((m_start + BLOCK_M - 1) // (R * W), rows - 1)
    for s in range(m_start // (R * W), last + 1):  # each sample of the tile: its own decode keys
        b = row_lo + s
        length = tl.load(LENS + b)
        m_i, l_i, acc = _attend_keys(
            q, DK + b * stride_dkb + kvh * stride_dkh, DV + b * stride_dvb + kvh * stride_dvh,
            stride_dkc, stride_dkd, stride_dvc, stride_dvd, offs_d, d_ok, length,
            tl.minimum(tl.load(BASE + b) + pos + 1, length), row_ok & (sample == s), m_i, l_i, acc, qk_scale,
            BLOCK_N, PRECISION, DOT_FP32)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a query that saw no key gets 0
    o_ptrs = (Out + row[:, None] * stride_ob + head[:, None] * stride_oh + pos[:, None] * stride_ow
              + offs_d[None, :])
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _blocks(device: torch.device) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): small tiles for the CPU interpreter, larger ones on a GPU."""
    if device.type == "cpu" or triton_interpreted():
        return 16, 16
    return 64, 64


def _dot_fp32(q: torch.Tensor) -> bool:
    """Upcast tl.dot operands to fp32 under the interpreter (its bf16/fp16 dot is wrong) or for fp32."""
    return q.dtype == torch.float32 or q.device.type == "cpu" or triton_interpreted()


def _check_runnable(q: torch.Tensor) -> None:
    if q.device.type == "cpu" and not triton_interpreted():
        raise RuntimeError(
            "the Triton attention kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is imported"
        )


# ---------------------------------------------------------------------------------- launch plans (cached)
LaunchPlan = tuple[int, tuple[torch.Tensor, ...]]  # (tile count, the kernel's table arguments on the device)
_PLAN_CACHE: OrderedDict[tuple, LaunchPlan] = OrderedDict()
_PLAN_CACHE_SIZE = 4096  # per layer and layout version; each entry a few small tensors
_plan_lock = threading.Lock()
_retainers: list[list[object]] = []


def _cached_plan(key: tuple, build: Callable[[], LaunchPlan]) -> LaunchPlan:
    """The plan of ``key``, built once (LRU of ``_PLAN_CACHE_SIZE``), and kept by every open retainer."""
    with _plan_lock:
        plan = _PLAN_CACHE.get(key)
        if plan is None:
            plan = _PLAN_CACHE[key] = build()
            if len(_PLAN_CACHE) > _PLAN_CACHE_SIZE:
                _PLAN_CACHE.popitem(last=False)
        else:
            _PLAN_CACHE.move_to_end(key)
        for kept in _retainers:
            kept.append(plan)
    return plan


@contextmanager
def retain_launch_tensors() -> Iterator[list[object]]:
    """Collect the cached launch tensors the kernels read inside the block into the yielded list.

    A CUDA graph captured in the block replays those tensors' addresses: whoever keeps the graph keeps
    the list with it, so the cache can evict them without the graph reading freed memory.
    """
    kept: list[object] = []
    with _plan_lock:
        _retainers.append(kept)
    try:
        yield kept
    finally:
        with _plan_lock:
            _retainers.remove(kept)


def _level_key(level: ContextLevel) -> tuple:
    k, v = level.k, level.v
    return (k.data_ptr(), v.data_ptr(), tuple(k.shape), tuple(v.shape), k.stride(), v.stride(), k.dtype,
            level.prefix_offsets, level.group_offsets, level.row_lo)


def _check_level(level: ContextLevel, decode_k: torch.Tensor, batch: int) -> None:
    """Raise ValueError when a level does not fit the decode cache [B, Hkv, C, D] and the batch."""
    k, v = level.k, level.v
    hkv, dim = decode_k.shape[1], decode_k.shape[3]
    if k.dim() != 3 or k.shape != v.shape or (k.shape[0], k.shape[2]) != (hkv, dim):
        raise ValueError(f"a level's k/v must be [{hkv}, P, {dim}], got {tuple(k.shape)}/{tuple(v.shape)}")
    if k.dtype != decode_k.dtype or v.dtype != decode_k.dtype or k.device != decode_k.device:
        raise ValueError("every level must have the decode cache's dtype and device")
    offsets, groups = level.prefix_offsets, level.group_offsets
    if len(offsets) != len(groups) or len(offsets) < 2 or offsets[0] != 0 or offsets[-1] > k.shape[1]:
        raise ValueError(f"a level's prefix offsets {offsets} do not fit its {k.shape[1]} keys")
    if any(b < a for a, b in pairwise(offsets)) or any(b < a for a, b in pairwise(groups)):
        raise ValueError("a level's offsets must be non-decreasing")
    if level.row_lo < 0 or level.row_hi > batch:
        raise ValueError(f"a level reaches rows [{level.row_lo}, {level.row_hi}) of a batch of {batch}")


def _build_plan(levels: Sequence[ContextLevel], batch: int, rows_per_sample: int, block_m: int,
                device: torch.device) -> LaunchPlan:
    """Cut the rows at every segment boundary into intervals, list each interval's chain of segments, and
    tile every interval's folded rows by ``block_m``."""
    segments: list[list[int]] = []
    reach: list[tuple[int, int]] = []  # rows [lo, hi) of each segment
    bounds = {0, batch}
    for level in levels:
        k, v = level.k, level.v
        for g in range(len(level.group_offsets) - 1):
            lo, hi = level.row_lo + level.group_offsets[g], level.row_lo + level.group_offsets[g + 1]
            start, length = level.prefix_offsets[g], level.prefix_offsets[g + 1] - level.prefix_offsets[g]
            if hi == lo or length == 0:
                continue
            segments.append([k.data_ptr() + start * k.stride(1) * k.element_size(),
                             v.data_ptr() + start * v.stride(1) * v.element_size(), length,
                             *k.stride(), *v.stride()])
            reach.append((lo, hi))
            bounds.update((lo, hi))
    edges = sorted(bounds)
    chain: list[int] = []
    chain_offsets, tile_interval, tile_start = [0], [], []
    for i, (lo, hi) in enumerate(pairwise(edges)):
        chain.extend(s for s, (s_lo, s_hi) in enumerate(reach) if s_lo <= lo and hi <= s_hi)
        chain_offsets.append(len(chain))
        for start in range(0, (hi - lo) * rows_per_sample, block_m):
            tile_interval.append(i)
            tile_start.append(start)
    table = torch.tensor(segments or [[0] * _SEGMENT_FIELDS], dtype=torch.int64, device=device)
    ints = [chain or [0], tile_interval, tile_start, chain_offsets, edges]
    return len(tile_interval), (table, *(torch.tensor(x, dtype=torch.int32, device=device) for x in ints))


def cascade_attention_triton(q: torch.Tensor, levels: Sequence[ContextLevel], decode_k: torch.Tensor,
                             decode_v: torch.Tensor, decode_base: torch.Tensor, decode_lens: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """Triton cascade attention; same arguments (less the part functions) and guarantees as
    :func:`kernels.cascade.cascade_attention`: q [B, Hq, W, D] attends every level segment reaching its row
    and its decode keys ``j < min(decode_base[b] + i + 1, decode_lens[b])``. Returns [B, Hq, W, D] in q's
    dtype, in one launch. Raises ValueError for levels that do not fit the batch or the decode cache; on CPU
    tensors it requires ``TRITON_INTERPRET=1`` (set before importing triton)."""
    _check_runnable(q)
    r = decode_head_ratio(q, decode_k)
    if decode_v.shape != decode_k.shape:
        raise ValueError("decode_k and decode_v must have the same shape")
    batch, _, window, dim = q.shape
    out = torch.empty_like(q)
    if batch == 0:
        return out
    block_m, block_n = _blocks(q.device)
    key = (tuple(_level_key(level) for level in levels), batch, r * window, block_m, q.device)

    def build() -> LaunchPlan:
        for level in levels:
            _check_level(level, decode_k, batch)
        return _build_plan(levels, batch, r * window, block_m, q.device)

    tiles, tables = _cached_plan(key, build)
    base = decode_base.to(device=q.device, dtype=torch.int32).contiguous()
    lens = decode_lens.to(device=q.device, dtype=torch.int32).contiguous()
    _cascade_kernel[(tiles, decode_k.shape[1])](
        q, out, decode_k, decode_v, base, lens, *tables,
        *q.stride(), *decode_k.stride(), *decode_v.stride(), out.stride(0), out.stride(1), out.stride(2),
        scale * _LOG2E, R=r, W=window, D=dim, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(max(dim, 16)), PRECISION="ieee", DOT_FP32=_dot_fp32(q),
        FIELDS=_SEGMENT_FIELDS,
    )
    return out


def bifurcated_attention_triton(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    prefix_offsets: list[int],
    group_offsets: list[int],
    decode_k: torch.Tensor,
    decode_v: torch.Tensor,
    decode_base: torch.Tensor,
    decode_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton bifurcated attention; same signature and guarantees as ``kernels.bifurcated``'s version.

    Query ``i`` of row ``b`` (group ``g``) attends to the whole prefix of ``g`` and to its decode keys
    ``j < min(decode_base[b] + i + 1, decode_lens[b])``. Returns [B, Hq, W, D] in ``q``'s dtype. One launch
    for the whole ragged batch (the cascade kernel with one level), no intermediate state in memory.
    On CPU tensors it requires ``TRITON_INTERPRET=1`` (set before importing triton).
    """
    validate_layout(q, prefix_k, prefix_v, prefix_offsets, group_offsets, decode_k, decode_v)
    level = ContextLevel(prefix_k, prefix_v, tuple(prefix_offsets), tuple(group_offsets), 0)
    return cascade_attention_triton(q, [level], decode_k, decode_v, decode_base, decode_lens, scale)
