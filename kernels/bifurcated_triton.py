"""Bifurcated (shared-prefix) attention as Triton kernels (GPU; CPU via ``TRITON_INTERPRET=1``).

Same contract as :func:`kernels.bifurcated.bifurcated_attention`:

* ``_context_kernel``: one program per (tile of folded rows of one group, kv head). The folded rows of
  group ``g`` are its ``n`` samples x ``r`` query heads sharing the kv head x ``W`` window positions; the
  program loops over the group's prefix in blocks of ``BLOCK_N`` keys with an online softmax. The prefix is
  read in place, once per tile: never expanded n-fold. With ``WITH_DECODE`` (``bifurcated_attention_triton``)
  the same program then folds in the decode keys of each sample of its tile, row by row with the
  causal-window mask ``j < min(decode_base[b] + i + 1, decode_lens[b])``, and writes the final output in
  ``q``'s dtype: the whole attention of a layer is one launch, and the two parts need no merge (one running
  softmax covers both). Without it (the context part of cascade attention) it writes ``o`` (fp32) and ``lse``.
* ``_decode_kernel``: one program per (row, kv head, tile of the ``r * W`` folded rows) over the row's decode
  keys alone, writing ``o`` and ``lse`` (the decode part of cascade attention); a query with no visible key
  gets ``o = 0``, ``lse = -inf``.

Under the interpreter the environment variable ``TRITON_INTERPRET=1`` must be set before ``triton`` is
imported (the kernels are decorated at import time).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import triton
import triton.language as tl

from kernels import triton_interpreted
from kernels.bifurcated import decode_head_ratio, validate_layout

__all__ = ["bifurcated_attention_triton", "retain_launch_tensors", "triton_interpreted"]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


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
def _finish(m_i, l_i, acc):
    """(normalised output, natural-log LSE) of a running state; a query that saw no key gets (0, -inf)."""
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    return out, lse


@triton.jit
def _load_kv(ptrs, mask, DOT_FP32: tl.constexpr):
    """A block of keys or values, upcast to fp32 where tl.dot runs in fp32."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if DOT_FP32:  # the CPU interpreter's tl.dot is wrong for bf16/fp16 operands (triton 3.9)
        x = x.to(tl.float32)
    return x


@triton.jit
def _row_decode_keys(q, k_base, v_base, stride_kc, stride_kd, stride_vc, stride_vd, offs_d, d_ok, length,
                     limit, mine, m_i, l_i, acc, qk_scale,
                     BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """Fold one row's decode keys ``j < min(limit, length)`` into the running state of the folded queries
    ``mine`` (the other queries of q see none of them)."""
    for start in range(0, length, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n < length)[:, None] & d_ok[None, :]
        k = _load_kv(k_base + offs_n[:, None] * stride_kc + offs_d[None, :] * stride_kd, kv_mask, DOT_FP32)
        v = _load_kv(v_base + offs_n[:, None] * stride_vc + offs_d[None, :] * stride_vd, kv_mask, DOT_FP32)
        visible = (offs_n[None, :] < limit[:, None]) & mine[:, None]
        m_i, l_i, acc = _attend_block(q, k, v, visible, m_i, l_i, acc, qk_scale, PRECISION)
    return m_i, l_i, acc


@triton.jit
def _context_kernel(
    Q, K, V, Out, LSE, DK, DV, BASE, LENS,
    TILE_GROUP, TILE_START, PREFIX_OFF, GROUP_OFF,
    stride_qb, stride_qh, stride_qw, stride_qd,
    stride_kh, stride_kp, stride_kd,
    stride_vh, stride_vp, stride_vd,
    stride_dkb, stride_dkh, stride_dkc, stride_dkd,
    stride_dvb, stride_dvh, stride_dvc, stride_dvd,
    stride_ob, stride_oh, stride_ow,
    stride_lb, stride_lh,
    qk_scale,
    R: tl.constexpr, W: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, WITH_DECODE: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.load(TILE_GROUP + tile)
    m_start = tl.load(TILE_START + tile)
    row_lo = tl.load(GROUP_OFF + g)
    row_hi = tl.load(GROUP_OFF + g + 1)
    p_lo = tl.load(PREFIX_OFF + g)
    p_hi = tl.load(PREFIX_OFF + g + 1)
    m_total = (row_hi - row_lo) * (R * W)

    offs_m = m_start + tl.arange(0, BLOCK_M)
    row_ok = offs_m < m_total
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
    for start in range(p_lo, p_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < p_hi
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = _load_kv(K + kvh * stride_kh + offs_n[:, None] * stride_kp + offs_d[None, :] * stride_kd, kv_mask,
                     DOT_FP32)
        v = _load_kv(V + kvh * stride_vh + offs_n[:, None] * stride_vp + offs_d[None, :] * stride_vd, kv_mask,
                     DOT_FP32)
        m_i, l_i, acc = _attend_block(q, k, v, n_ok[None, :], m_i, l_i, acc, qk_scale, PRECISION)

    o_ptrs = (Out + row[:, None] * stride_ob + head[:, None] * stride_oh + pos[:, None] * stride_ow
              + offs_d[None, :])
    if WITH_DECODE:  # the whole attention in this launch: each sample of the tile adds its own decode keys
        last = tl.minimum((m_start + BLOCK_M - 1) // (R * W), row_hi - row_lo - 1)
        for s in range(m_start // (R * W), last + 1):
            b = row_lo + s
            length = tl.load(LENS + b)
            limit = tl.minimum(tl.load(BASE + b) + pos + 1, length)
            m_i, l_i, acc = _row_decode_keys(
                q, DK + b * stride_dkb + kvh * stride_dkh, DV + b * stride_dvb + kvh * stride_dvh,
                stride_dkc, stride_dkd, stride_dvc, stride_dvd, offs_d, d_ok, length, limit,
                row_ok & (sample == s), m_i, l_i, acc, qk_scale, BLOCK_N, PRECISION, DOT_FP32)
        out, _ = _finish(m_i, l_i, acc)
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        out, lse = _finish(m_i, l_i, acc)
        tl.store(o_ptrs, out, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LSE + row * stride_lb + head * stride_lh + pos, lse, mask=row_ok)


@triton.jit
def _decode_kernel(
    Q, K, V, Out, LSE, BASE, LENS,
    stride_qb, stride_qh, stride_qw, stride_qd,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_vb, stride_vh, stride_vc, stride_vd,
    stride_ob, stride_oh, stride_ow,
    stride_lb, stride_lh,
    qk_scale,
    R: tl.constexpr, W: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < R * W
    head = kvh * R + offs_m // W
    pos = offs_m % W
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    length = tl.load(LENS + row)
    limit = tl.minimum(tl.load(BASE + row) + pos + 1, length)  # [BLOCK_M]

    q_ptrs = (Q + row * stride_qb + head[:, None] * stride_qh + pos[:, None] * stride_qw
              + offs_d[None, :] * stride_qd)
    q = _load_kv(q_ptrs, row_ok[:, None] & d_ok[None, :], DOT_FP32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i, l_i, acc = _row_decode_keys(
        q, K + row * stride_kb + kvh * stride_kh, V + row * stride_vb + kvh * stride_vh, stride_kc, stride_kd,
        stride_vc, stride_vd, offs_d, d_ok, length, limit, row_ok, m_i, l_i, acc, qk_scale, BLOCK_N, PRECISION,
        DOT_FP32)
    out, lse = _finish(m_i, l_i, acc)
    o_ptrs = Out + row * stride_ob + head[:, None] * stride_oh + pos[:, None] * stride_ow + offs_d[None, :]
    tl.store(o_ptrs, out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + row * stride_lb + head * stride_lh + pos, lse, mask=row_ok)


def _blocks(device: torch.device) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): small tiles for the CPU interpreter, larger ones on a GPU."""
    if device.type == "cpu" or triton_interpreted():
        return 16, 16
    return 64, 64


def _output_args(out: torch.Tensor, lse: torch.Tensor, scale: float) -> tuple:
    """The launch arguments both kernels take after their inputs: output/LSE strides and the log2 scale."""
    return (out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), scale * _LOG2E)


def _constexprs(q: torch.Tensor, r: int, block_m: int, block_n: int) -> dict[str, object]:
    """Compile-time parameters both kernels share, for queries q [B, Hq, W, D] and r query heads per kv head."""
    window, dim = q.shape[2], q.shape[3]
    return dict(R=r, W=window, D=dim, BLOCK_M=block_m, BLOCK_N=block_n,
                BLOCK_D=triton.next_power_of_2(max(dim, 16)), PRECISION="ieee", DOT_FP32=_dot_fp32(q))


def _dot_fp32(q: torch.Tensor) -> bool:
    """Upcast tl.dot operands to fp32 under the interpreter (its bf16/fp16 dot is wrong) or for fp32."""
    return q.dtype == torch.float32 or q.device.type == "cpu" or triton_interpreted()


TileArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
_TILE_CACHE: OrderedDict[tuple, tuple[int, TileArgs]] = OrderedDict()
_TILE_CACHE_SIZE = 512
_tile_lock = threading.Lock()
_retainers: list[list[object]] = []


def _context_tiles(prefix_offsets: Sequence[int], group_offsets: Sequence[int], rows_per_sample: int,
                   block_m: int, device: torch.device) -> tuple[int, TileArgs]:
    """(tile count, int32 (tile group, tile start, prefix offsets, group offsets) on ``device``) of the
    context kernel, one tile per ``block_m`` folded rows of a group. Cached per layout (so a step replayed
    from a CUDA graph reads the same tensors, and a warm step copies nothing to the device)."""
    key = (tuple(prefix_offsets), tuple(group_offsets), rows_per_sample, block_m, device)
    with _tile_lock:
        entry = _TILE_CACHE.get(key)
        if entry is None:
            tile_group, tile_start = [], []
            for g in range(len(group_offsets) - 1):
                rows = (group_offsets[g + 1] - group_offsets[g]) * rows_per_sample
                for start in range(0, rows, block_m):
                    tile_group.append(g)
                    tile_start.append(start)
            ints = [tile_group, tile_start, list(prefix_offsets), list(group_offsets)]
            tensors = tuple(torch.tensor(v, dtype=torch.int32, device=device) for v in ints)
            entry = _TILE_CACHE[key] = (len(tile_group), tensors)
            if len(_TILE_CACHE) > _TILE_CACHE_SIZE:
                _TILE_CACHE.popitem(last=False)
        else:
            _TILE_CACHE.move_to_end(key)
        for kept in _retainers:
            kept.append(entry)
    return entry


@contextmanager
def retain_launch_tensors() -> Iterator[list[object]]:
    """Collect the cached launch tensors the kernels read inside the block into the yielded list.

    A CUDA graph captured in the block replays those tensors' addresses: whoever keeps the graph keeps
    the list with it, so the cache can evict them without the graph reading freed memory.
    """
    kept: list[object] = []
    with _tile_lock:
        _retainers.append(kept)
    try:
        yield kept
    finally:
        with _tile_lock:
            _retainers.remove(kept)


def _check_runnable(q: torch.Tensor) -> None:
    if q.device.type == "cpu" and not triton_interpreted():
        raise RuntimeError(
            "bifurcated_attention_triton on CPU tensors needs TRITON_INTERPRET=1 set before triton is "
            "imported"
        )


def _launch_context(q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, prefix_offsets: list[int],
                    group_offsets: list[int], scale: float, out: torch.Tensor, lse: torch.Tensor,
                    decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
    """Launch ``_context_kernel`` once for the whole batch: into ``out``/``lse`` (fp32) over the prefixes, or
    with ``decode = (decode_k, decode_v, base, lens)`` the whole attention into ``out`` (``lse`` unused)."""
    r = validate_layout(q, prefix_k, prefix_v, prefix_offsets, group_offsets)
    block_m, block_n = _blocks(q.device)
    tiles, tile_args = _context_tiles(prefix_offsets, group_offsets, r * q.shape[2], block_m, q.device)
    if not tiles:
        return
    if decode is None:  # the decode operands are never read: any tensors, zero strides
        decode_args, decode_strides = (q, q, tile_args[0], tile_args[0]), (0,) * 8
    else:
        decode_k, decode_v, base, lens = decode
        decode_args = (decode_k, decode_v, base.to(device=q.device, dtype=torch.int32).contiguous(),
                       lens.to(device=q.device, dtype=torch.int32).contiguous())
        decode_strides = (*decode_k.stride(), *decode_v.stride())
    _context_kernel[(tiles, prefix_k.shape[0])](
        q, prefix_k, prefix_v, out, lse, *decode_args, *tile_args,
        *q.stride(), *prefix_k.stride(), *prefix_v.stride(), *decode_strides,
        *_output_args(out, lse, scale), **_constexprs(q, r, block_m, block_n), WITH_DECODE=decode is not None,
    )


def context_attention_triton(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    prefix_offsets: list[int],
    group_offsets: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton context part: ``(o [B, Hq, W, D] fp32, lse [B, Hq, W] fp32)`` over each group's prefix.

    Same guarantees as :func:`kernels.bifurcated.context_attention`; one program per (tile of the
    n * r * W folded rows of a group, kv head), the prefix read in place.
    """
    _check_runnable(q)
    batch, hq, window, dim = q.shape
    out = torch.empty(batch, hq, window, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, hq, window, dtype=torch.float32, device=q.device)
    _launch_context(q, prefix_k, prefix_v, prefix_offsets, group_offsets, scale, out, lse, None)
    return out, lse


def decode_attention_triton(
    q: torch.Tensor,
    decode_k: torch.Tensor,
    decode_v: torch.Tensor,
    decode_base: torch.Tensor,
    decode_lens: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton decode part: ``(o, lse)`` fp32 over each row's own decode keys (causal inside the window).

    Same guarantees as :func:`kernels.bifurcated.decode_attention`; a query with no visible key gets
    ``o = 0``, ``lse = -inf``.
    """
    _check_runnable(q)
    batch, hq, window, dim = q.shape
    hkv = decode_k.shape[1]
    r = decode_head_ratio(q, decode_k)
    block_m, block_n = _blocks(q.device)
    out = torch.empty(batch, hq, window, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, hq, window, dtype=torch.float32, device=q.device)
    if batch == 0:
        return out, lse
    base = decode_base.to(device=q.device, dtype=torch.int32).contiguous()
    lens = decode_lens.to(device=q.device, dtype=torch.int32).contiguous()
    grid = (batch, hkv, triton.cdiv(r * window, block_m))
    _decode_kernel[grid](
        q, decode_k, decode_v, out, lse, base, lens,
        *q.stride(), *decode_k.stride(), *decode_v.stride(),
        *_output_args(out, lse, scale), **_constexprs(q, r, block_m, block_n),
    )
    return out, lse


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
    for the whole ragged batch (``_context_kernel`` with its decode phase), no intermediate state in memory.
    On CPU tensors it requires ``TRITON_INTERPRET=1`` (set before importing triton).
    """
    _check_runnable(q)
    validate_layout(q, prefix_k, prefix_v, prefix_offsets, group_offsets, decode_k, decode_v)
    out = torch.empty_like(q)
    _launch_context(q, prefix_k, prefix_v, prefix_offsets, group_offsets, scale, out, out,
                    (decode_k, decode_v, decode_base, decode_lens))
    return out
