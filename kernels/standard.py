"""Standard attention over an expanded KV cache: every sequence holds its own copy of the prompt KV.

This is the layout of naive batching (and of HF ``generate(num_return_sequences=n)``): the baseline
that bifurcated attention is measured against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def window_key_mask(base: torch.Tensor, lens: torch.Tensor, window: int, capacity: int) -> torch.Tensor:
    """Boolean mask [B, 1, W, C]: query i of row b sees keys j < min(base[b] + i + 1, lens[b])."""
    i = torch.arange(window, device=base.device)
    j = torch.arange(capacity, device=base.device)
    limit = torch.minimum(base[:, None] + i[None, :] + 1, lens[:, None])  # [B, W]
    return (j[None, None, :] < limit[:, :, None])[:, None]


def standard_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    base: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of q [B, Hq, W, D] over per-row caches k, v [B, Hkv, C, D].

    Query i of row b attends to keys j < min(base[b] + i + 1, lens[b]) (causal inside the window).
    Returns [B, Hq, W, D]. GQA/MQA are handled by SDPA's grouped-query support, without copying KV.
    """
    mask = window_key_mask(base, lens, q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def full_cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``standard_attention`` for the case where every row's window ends at the last cache slot (lens[b] ==
    C and base[b] == C - W for every b), as in the benchmarks: SDPA without a mask (W == 1) or with the
    lower-right causal bias (W > 1), the form PyTorch runs with its flash-attention kernels on CUDA."""
    window, capacity = q.shape[2], k.shape[2]
    mask = causal_lower_right(window, capacity) if window > 1 else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def expand_bifurcated_kv(
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    prefix_offsets: list[int],
    group_offsets: list[int],
    decode_k: torch.Tensor,
    decode_v: torch.Tensor,
    decode_base: torch.Tensor,
    decode_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Build the expanded (per-row) KV layout equivalent to a bifurcated one, for tests and benchmarks.

    Row ``b`` of group ``g`` gets ``concat(prefix of g, decode_k[b])``: keys ``[0, P_g)`` are a copy of the
    group's prefix and keys ``[P_g, P_g + C)`` its decode cache, in a cache of capacity ``max(P_g) + C``.
    Returns ``(k, v, base, lens)`` with ``base = P_g + decode_base`` and ``lens = P_g + decode_lens``, so
    that ``standard_attention(q, k, v, base, lens, scale)`` equals bifurcated attention. The prefix is
    copied n-fold (that is the layout being measured against).
    """
    batch, hkv, cap, dim = decode_k.shape
    groups = len(group_offsets) - 1
    plens = [prefix_offsets[g + 1] - prefix_offsets[g] for g in range(groups)]
    total = max(plens) + cap
    k = decode_k.new_zeros(batch, hkv, total, dim)
    v = decode_v.new_zeros(batch, hkv, total, dim)
    row_plen = torch.empty(batch, dtype=torch.int64, device=decode_base.device)
    for g in range(groups):
        lo, hi = group_offsets[g], group_offsets[g + 1]
        plo, phi = prefix_offsets[g], prefix_offsets[g + 1]
        plen = phi - plo
        k[lo:hi, :, :plen] = prefix_k[:, plo:phi].unsqueeze(0)
        v[lo:hi, :, :plen] = prefix_v[:, plo:phi].unsqueeze(0)
        k[lo:hi, :, plen : plen + cap] = decode_k[lo:hi]
        v[lo:hi, :, plen : plen + cap] = decode_v[lo:hi]
        row_plen[lo:hi] = plen
    return k, v, row_plen + decode_base.to(torch.int64), row_plen + decode_lens.to(torch.int64)
