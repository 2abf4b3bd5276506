"""Standard attention over an expanded KV cache: every sequence holds its own copy of the prompt KV.

This is the layout of naive batching (and of HF ``generate(num_return_sequences=n)``): the baseline
that bifurcated attention is measured against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
