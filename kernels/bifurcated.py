"""Bifurcated (shared-prefix) attention: the PyTorch (matmul-based) implementation, used on CPU.

Layout. A *group* is one prompt shared by ``n`` samples (rows ``group_offsets[g]:group_offsets[g+1]`` of
the batch). Its prompt KV (the *prefix*) is stored once, in ``prefix_k/prefix_v[:, prefix_offsets[g]:
prefix_offsets[g+1]]``; every row ``b`` has its own decode cache ``decode_k/decode_v[b]``.

Attention of query ``i`` of row ``b`` is a softmax over ``[prefix keys of its group ; its decode keys
j < min(decode_base[b] + i + 1, decode_lens[b])]``. It is computed in two parts that are merged exactly:

* context part: for each (group, kv head) ONE GEMM whose M dimension folds the ``n`` samples, the ``r``
  query heads that share the kv head (GQA) and the ``W`` window positions, against the prefix keys that
  are read once (no n-fold expanded copy of the prefix);
* decode part: batched over rows against the per-row decode caches, causal inside the window;
* merge: ``o = (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2)``, computed stably (an empty part has
  ``lse = -inf`` and weight 0).

Softmax statistics (max, sum, log-sum-exp) and the merge are fp32; the two GEMMs run in fp32 for fp32
inputs and in the input dtype (with fp32 accumulation) for bf16/fp16, like flash attention; the result
has ``q``'s dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "bifurcated_attention",
    "context_attention",
    "decode_attention",
    "merge_attention_states",
    "merge_states",
    "kv_cache_bytes",
    "validate_layout",
]


def validate_layout(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    prefix_offsets: Sequence[int],
    group_offsets: Sequence[int],
    decode_k: torch.Tensor | None = None,
    decode_v: torch.Tensor | None = None,
) -> int:
    """Check the shapes of a bifurcated layout; return the GQA ratio r = Hq // Hkv.

    Raises ``ValueError`` when a shape or an offset list is inconsistent (different number of groups,
    offsets that do not cover the batch / the packed prefix, empty prefix, Hq not a multiple of Hkv).
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [B, Hq, W, D], got {tuple(q.shape)}")
    batch, hq, _, dim = q.shape
    if prefix_k.dim() != 3 or prefix_k.shape != prefix_v.shape:
        raise ValueError(
            f"prefix_k/v must be [Hkv, Ptot, D], got {tuple(prefix_k.shape)}/{tuple(prefix_v.shape)}"
        )
    hkv, ptot, pdim = prefix_k.shape
    if pdim != dim or hq % hkv != 0:
        raise ValueError(f"incompatible heads/dims: q {tuple(q.shape)}, prefix {tuple(prefix_k.shape)}")
    if len(prefix_offsets) != len(group_offsets) or len(prefix_offsets) < 2:
        raise ValueError("prefix_offsets and group_offsets must both have G+1 >= 2 entries")
    if prefix_offsets[0] != 0 or prefix_offsets[-1] != ptot:
        raise ValueError(f"prefix_offsets must span [0, {ptot}], got {list(prefix_offsets)}")
    if group_offsets[0] != 0 or group_offsets[-1] != batch:
        raise ValueError(f"group_offsets must span [0, {batch}], got {list(group_offsets)}")
    for g in range(len(prefix_offsets) - 1):
        if prefix_offsets[g + 1] - prefix_offsets[g] < 1:
            raise ValueError(f"group {g} has an empty prefix")
        if group_offsets[g + 1] < group_offsets[g]:
            raise ValueError("group_offsets must be non-decreasing")
    if decode_k is not None:
        if decode_v is None or decode_k.shape != decode_v.shape:
            raise ValueError("decode_k and decode_v must have the same shape")
        dshape = tuple(decode_k.shape)
        if len(dshape) != 4 or (dshape[0], dshape[1], dshape[3]) != (batch, hkv, dim):
            raise ValueError(f"decode_k must be [B, Hkv, C, D], got {tuple(decode_k.shape)}")
    return hq // hkv


def _gemm_dtype(q: torch.Tensor) -> torch.dtype:
    """dtype of the two GEMMs: q's dtype for bf16/fp16 (fp32 accumulation inside the GEMM; the K/V are read
    in place, never upcast), fp32 otherwise. Softmax statistics are always fp32."""
    return q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32


def _softmax_parts(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (softmax(scores) @ v, logsumexp(scores)) in fp32; rows that are all -inf give (0, -inf).

    ``scores`` is fp32 (freshly allocated by the caller; it is overwritten in place with the unnormalised
    probabilities). The probabilities are cast to ``v``'s dtype for the second GEMM.
    """
    m = scores.amax(dim=-1, keepdim=True)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = scores.sub_(m_safe).exp_()
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.matmul(p.to(v.dtype), v).to(torch.float32)
    out = out.div_(torch.where(denom > 0, denom, torch.ones_like(denom)))
    lse = (m_safe + torch.log(denom)).squeeze(-1)
    return out, lse


_FUSED_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _fused_parts(qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(qg kg^T * scale) vg, logsumexp) for [Hkv, M, D] queries over [Hkv, P, D] keys with PyTorch's
    fused CPU flash-attention primitive: the same folded-rows product, tiled so the scores stay in cache."""
    out, lse = _FUSED_CPU(qg[None], kg[None], vg[None], 0.0, False, scale=scale)
    return out[0].to(torch.float32), lse[0]


def context_attention(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    prefix_offsets: Sequence[int],
    group_offsets: Sequence[int],
    scale: float,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over the shared prefix of its group only.

    Returns ``(o, lse)``: ``o`` [B, Hq, W, D] fp32 and ``lse`` [B, Hq, W] fp32 (log-sum-exp of the scaled
    scores). Each (group, kv head) is ONE product with M = n * r * W folded rows against the prefix keys of
    the group, which are read in place (never copied n-fold). Every prefix has >= 1 key, so lse is finite.
    ``fused`` (default: on CPU tensors when available) computes each group's product with PyTorch's fused
    CPU flash-attention primitive instead of two matmuls and a materialized score matrix; both give the
    same result up to rounding.
    """
    if fused is None:
        fused = q.device.type == "cpu" and _FUSED_CPU is not None
    r = validate_layout(q, prefix_k, prefix_v, prefix_offsets, group_offsets)
    batch, hq, window, dim = q.shape
    hkv = prefix_k.shape[0]
    out = torch.empty(batch, hq, window, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, hq, window, dtype=torch.float32, device=q.device)
    cdt = _gemm_dtype(q)
    for g in range(len(group_offsets) - 1):
        lo, hi = group_offsets[g], group_offsets[g + 1]
        if hi == lo:
            continue
        n = hi - lo
        plo, phi = prefix_offsets[g], prefix_offsets[g + 1]
        # [n, Hq, W, D] -> [Hkv, n * r * W, D]: samples, shared query heads and window fold into M.
        qg = q[lo:hi].reshape(n, hkv, r, window, dim).transpose(0, 1).reshape(hkv, n * r * window, dim)
        kg = prefix_k[:, plo:phi].to(cdt)  # a view (the shared prefix is read in place)
        vg = prefix_v[:, plo:phi].to(cdt)
        if fused:
            og, lg = _fused_parts(qg.to(cdt), kg, vg, scale)
        else:
            qg = (qg.to(torch.float32) * scale).to(cdt)
            scores = torch.matmul(qg, kg.transpose(-1, -2)).to(torch.float32)  # [Hkv, M, P]
            og, lg = _softmax_parts(scores, vg)
        out[lo:hi] = og.reshape(hkv, n, r, window, dim).transpose(0, 1).reshape(n, hq, window, dim)
        lse[lo:hi] = lg.reshape(hkv, n, r, window).transpose(0, 1).reshape(n, hq, window)
    return out, lse


def decode_head_ratio(q: torch.Tensor, decode_k: torch.Tensor) -> int:
    """Query heads per kv head for q [B, Hq, W, D] over a decode cache [B, Hkv, C, D]; raises ValueError
    when the batch, head or dim sizes do not fit together."""
    batch, hq, _, dim = q.shape
    hkv = decode_k.shape[1]
    if hq % hkv != 0 or decode_k.shape[0] != batch or decode_k.shape[3] != dim:
        raise ValueError(f"incompatible q {tuple(q.shape)} and decode cache {tuple(decode_k.shape)}")
    return hq // hkv


def decode_attention(
    q: torch.Tensor,
    decode_k: torch.Tensor,
    decode_v: torch.Tensor,
    decode_base: torch.Tensor,
    decode_lens: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over its own row's decode keys only (causal inside the window).

    Query ``i`` of row ``b`` sees decode keys ``j < min(decode_base[b] + i + 1, decode_lens[b])``.
    Returns ``(o, lse)`` in fp32, shaped [B, Hq, W, D] and [B, Hq, W]; a query that sees no key (e.g.
    ``decode_lens[b] == 0``) gets ``o = 0`` and ``lse = -inf``. Only the first ``max(decode_lens)`` cache
    slots are read.
    """
    batch, hq, window, dim = q.shape
    hkv = decode_k.shape[1]
    r = decode_head_ratio(q, decode_k)
    out = torch.zeros(batch, hq, window, dim, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, hq, window), float("-inf"), dtype=torch.float32, device=q.device)
    if batch == 0:
        return out, lse
    used = int(decode_lens.max().item())
    if used <= 0:
        return out, lse
    if used > decode_k.shape[2]:
        raise ValueError(f"decode_lens ({used}) exceeds the decode capacity {decode_k.shape[2]}")
    base = decode_base.to(device=q.device, dtype=torch.int64)
    lens = decode_lens.to(device=q.device, dtype=torch.int64)
    cdt = _gemm_dtype(q)
    k = decode_k[:, :, :used].to(cdt)
    v = decode_v[:, :, :used].to(cdt)
    qf = (q.reshape(batch, hkv, r * window, dim).to(torch.float32) * scale).to(cdt)  # r heads fold into M
    scores = torch.matmul(qf, k.transpose(-1, -2)).to(torch.float32).view(batch, hkv, r, window, used)
    i = torch.arange(window, device=q.device)
    j = torch.arange(used, device=q.device)
    limit = torch.minimum(base[:, None] + i[None, :] + 1, lens[:, None])  # [B, W]
    visible = j[None, None, :] < limit[:, :, None]  # [B, W, used]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf")).view(batch, hkv, r * window, used)
    o, lg = _softmax_parts(scores, v)
    return o.reshape(batch, hq, window, dim), lg.reshape(batch, hq, window)


def merge_attention_states(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> torch.Tensor:
    """Exact merge of two attention results over disjoint key sets.

    ``o = (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2)`` computed in fp32 with the max subtracted; a part
    with ``lse = -inf`` (no key) has weight 0, and when both are empty the result is 0. ``o*`` are
    [..., D] and ``lse*`` are [...]. Returns ``o1``'s dtype.
    """
    out, _ = merge_states(o1.to(torch.float32), lse1.to(torch.float32), o2.to(torch.float32),
                          lse2.to(torch.float32))
    return out.to(o1.dtype)


def merge_states(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact merge of two fp32 attention states over disjoint keys: (o [..., D], lse [...]). A part with
    lse = -inf has weight 0; both empty gives (0, -inf)."""
    m = torch.maximum(lse1, lse2)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w1 = torch.exp(lse1 - m_safe)
    w2 = torch.exp(lse2 - m_safe)
    total = w1 + w2
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = o1 * (w1 / safe)[..., None] + o2 * (w2 / safe)[..., None]
    return out, m_safe + torch.log(total)


def bifurcated_attention(
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
    """Bifurcated attention of q [B, Hq, W, D] over shared prefixes plus per-row decode caches.

    Query ``i`` of row ``b`` (group ``g``) attends to all of ``prefix_k/v[:, prefix_offsets[g]:
    prefix_offsets[g+1]]`` and to ``decode_k/v[b, :, j]`` for ``j < min(decode_base[b] + i + 1,
    decode_lens[b])``. Equal (up to fp32 rounding) to softmax attention over the expanded per-row KV;
    the prefix is never copied n-fold. Returns [B, Hq, W, D] in ``q``'s dtype.
    """
    validate_layout(q, prefix_k, prefix_v, prefix_offsets, group_offsets, decode_k, decode_v)
    o_ctx, lse_ctx = context_attention(q, prefix_k, prefix_v, prefix_offsets, group_offsets, scale)
    o_dec, lse_dec = decode_attention(q, decode_k, decode_v, decode_base, decode_lens, scale)
    return merge_attention_states(o_ctx, lse_ctx, o_dec, lse_dec).to(q.dtype)


def kv_cache_bytes(
    prefix_lens: Sequence[int],
    samples: Sequence[int],
    decode_len: int,
    kv_heads: int,
    head_dim: int,
    element_size: int,
    layers: int = 1,
) -> dict[str, int]:
    """KV-cache bytes (K and V, all layers) of the bifurcated and of the expanded (standard) layout.

    Group ``g`` has a prompt of ``prefix_lens[g]`` tokens shared by ``samples[g]`` rows, each row holding
    ``decode_len`` decode tokens. The bifurcated layout stores each prompt once; the expanded layout stores
    it once per sample, so ``prompt_standard == sum(n_g * P_g) * per_token`` vs ``prompt_bifurcated ==
    sum(P_g) * per_token`` (exactly n-fold smaller for one group of n). Returns a dict with keys
    ``prompt_bifurcated``, ``prompt_standard``, ``decode``, ``bifurcated``, ``standard`` (totals include the
    decode part, identical in both layouts).
    """
    if len(prefix_lens) != len(samples):
        raise ValueError("prefix_lens and samples must have one entry per group")
    per_token = 2 * kv_heads * head_dim * element_size * layers
    prompt_bif = sum(prefix_lens) * per_token
    prompt_std = sum(p * n for p, n in zip(prefix_lens, samples, strict=True)) * per_token
    decode = sum(samples) * decode_len * per_token
    return {
        "prompt_bifurcated": prompt_bif,
        "prompt_standard": prompt_std,
        "decode": decode,
        "bifurcated": prompt_bif + decode,
        "standard": prompt_std + decode,
    }
