"""Logits processing and lossless speculative sampling, shared by the draft and target services.

Pipeline for one generated position of one sequence:

1. ``process_logits`` turns raw logits into the *processed* distribution (temperature, top-k, top-p; or a
   one-hot argmax for greedy requests). The target's processed distribution ``p`` is the distribution
   the service promises to sample from.
2. The draft proposes tokens. For sampling requests it does **not** sample from its full processed
   distribution: it first encodes it compactly (``compact_distribution``: at most ``max_support`` tokens,
   fp16 probabilities) and then samples from ``CompactDistribution.to_dense()`` -- exactly the
   distribution ``q`` it transmits to the target.
3. The target rebuilds ``q`` from the same bytes (``to_dense`` is deterministic) and runs
   ``verify_windows``: token ``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``; at
   the first rejection the next token is drawn from ``norm(max(0, p_i - q_i))``; if every proposed token is
   accepted a bonus token is drawn from ``p_k``. ``p_i`` and ``q_i`` are built only for the positions a row
   reaches (``verify_proposals`` is the same decision on distributions built already).

Why this is lossless: speculative sampling (Leviathan et al. 2023; Chen et al. 2023) yields tokens
distributed exactly according to ``p`` for **any** draft distribution ``q``, provided the ``q`` used in
the acceptance test is the one the proposed token was actually drawn from. Truncating and quantizing the
draft distribution therefore costs acceptance rate, never correctness, because the draft samples from the
truncated/quantized distribution itself and the target uses that same distribution. Greedy requests need
no distributions at all: a draft token is accepted iff it equals the target's argmax.

Randomness: every sequence owns one CPU ``torch.Generator`` per role (``sequence_generator``), and every
call consumes a number of uniforms per sampling row fixed by that row's own proposal (``sample``: 1;
``verify_windows``: k_b + 1 for a proposal of k_b tokens), independently of what was accepted, so
results are reproducible and a row's outcome does not depend on the other rows of the batch. The
uniforms are drawn on the CPU and moved to the probabilities' device, so a seed gives the same stream
whether the model runs on the CPU or on a GPU.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.errors import InvalidInput
from engine.roles import check_role

__all__ = [
    "CompactDistribution",
    "SamplingParams",
    "compact_distribution",
    "draft_distribution",
    "greedy_accept",
    "point_distribution",
    "process_logits",
    "sample",
    "sequence_generator",
    "token_logprobs",
    "verify_proposals",
    "verify_windows",
]

_FP16_LE = np.dtype("<f2")
_CANDIDATES = (64, 2048)  # how many of a row's most probable tokens top-k/top-p ranks, until they decide it


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters. ``temperature == 0`` means greedy (argmax) decoding."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 = disabled
    seed: int = 0

    @property
    def greedy(self) -> bool:
        """True iff decoding is greedy (temperature exactly 0); top-k/top-p are then irrelevant."""
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ``InvalidInput`` (a ``ValueError``) naming the offending field if any parameter is invalid.

        Valid: finite ``temperature >= 0``; ``0 < top_p <= 1``; integer ``top_k >= 0``; integer ``seed >= 0``.
        """
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InvalidInput(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):  # NaN fails too
            raise InvalidInput(f"top_p must be in (0, 1], got {p!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise InvalidInput(f"top_k must be an integer >= 0, got {k!r}")
        s = self.seed
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0:
            raise InvalidInput(f"seed must be an integer >= 0, got {s!r}")


def sequence_generator(seed: int, sample_index: int, role: str) -> torch.Generator:
    """Return a CPU generator seeded deterministically from ``(seed, sample_index, role)``.

    The seed is a stable hash (BLAKE2b), so it is identical across processes, machines and Python
    versions; different samples and roles get independent streams.
    """
    check_role(role)
    digest = hashlib.blake2b(
        f"specserve/sampling/{int(seed)}/{int(sample_index)}/{role}".encode(), digest_size=8
    ).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return generator


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Turn logits ``[N, V]`` (any float dtype) into processed probabilities ``[N, V]`` float32.

    Row ``n`` uses ``params[n]``. Greedy rows become the one-hot of the argmax (ties: lowest index).
    Other rows: ``softmax(logits / T)``, then top-k (keep the k most probable; ties broken towards the lower
    token id), then top-p on the renormalized top-k distribution (keep the smallest prefix of most probable
    tokens whose mass reaches ``top_p``; the top-1 token is always kept), renormalized. Kept tokens of
    filtered rows have probability > 0 unless underflow in the softmax itself. The result is bit-for-bit
    deterministic for identical inputs on the same device.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    n_rows, vocab = logits.shape
    if len(params) != n_rows:
        raise ValueError(f"need one SamplingParams per row: {len(params)} params for {n_rows} rows")
    for p in params:
        p.validate()
    device = logits.device
    x = logits.float()
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    sample_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not sample_rows:  # all greedy (or no rows)
        return _argmax_one_hots(x)
    idx = torch.tensor(sample_rows, dtype=torch.long, device=device)
    xs = x if not greedy_rows else x[idx]
    temps = torch.tensor([params[i].temperature for i in sample_rows], dtype=torch.float32, device=device)
    # Shifting by the row max first is mathematically a no-op for the softmax but keeps tiny
    # temperatures from overflowing logits / T to inf.
    xs = (xs - xs.amax(dim=-1, keepdim=True)) / temps.unsqueeze(-1)
    probs = torch.softmax(xs, dim=-1)
    top_k = [params[i].top_k for i in sample_rows]
    top_p = [params[i].top_p for i in sample_rows]
    top_k = [k if 0 < k < vocab else 0 for k in top_k]
    needs = [j for j in range(len(sample_rows)) if top_k[j] or top_p[j] < 1.0]
    if len(needs) == len(sample_rows):
        _filter_top_k_top_p(probs, top_k, top_p)
    elif needs:
        sub = torch.tensor(needs, dtype=torch.long, device=device)
        probs[sub] = _filter_top_k_top_p(probs[sub], [top_k[j] for j in needs], [top_p[j] for j in needs])
    if not greedy_rows:
        return probs
    out = torch.zeros((n_rows, vocab), dtype=torch.float32, device=device)
    gidx = torch.tensor(greedy_rows, dtype=torch.long, device=device)
    out[gidx] = _argmax_one_hots(x[gidx])
    out[idx] = probs
    return out


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> list[float]:
    """``log_softmax(logits[r])[tokens[r]]`` for each row of ``logits [R, V]`` (``tokens [R]``), in float32 on the
    host: a token's log-probability under the model's own distribution, before temperature, top-k and top-p
    (what re-ranking scores completions by; vLLM's and OpenAI's default)."""
    x = logits.float()
    picked = x.gather(-1, tokens.to(device=x.device, dtype=torch.long).unsqueeze(-1)).squeeze(-1)
    return (picked - torch.logsumexp(x, dim=-1)).cpu().tolist()


def _argmax_one_hots(x: torch.Tensor) -> torch.Tensor:
    """float32 one-hots [N, V] of each row's argmax (ties: lowest index)."""
    return torch.zeros(x.shape, dtype=torch.float32, device=x.device).scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)


def _filter_top_k_top_p(probs: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> torch.Tensor:
    """Top-k then top-p filtering of normalized rows ``[R, V]`` in place, renormalized (per-row k, 0 for none,
    and p); returns ``probs``. Masses are float64 sums in rank (or id) order.

    Tokens rank by probability, ties towards the lower token id. Top-k keeps the ``top_k`` first ranks; top-p
    then keeps rank r iff the mass of the kept ranks before it is below ``top_p`` times the mass top-p is
    measured against (the top-k ranks' under top-k, else the row's), i.e. the shortest prefix reaching
    ``top_p`` (rank 0 always). A row is ranked by its most probable tokens alone (``_CANDIDATES``, then more)
    as soon as they decide it (``_nucleus``), at the latest by a sort of the whole row; either way a row's
    result depends on that row alone, bit for bit.
    """
    n_rows, vocab = probs.shape
    k = torch.tensor(top_k, dtype=torch.long, device=probs.device)
    p = torch.tensor(top_p, dtype=torch.float64, device=probs.device)
    if 0 in top_k:  # the row's mass, for top-p alone: a scan, the same bits whatever the other rows
        total = probs.double().cumsum(dim=-1)[:, -1]
    else:  # under top-k the mass is the top-k ranks' own (``_nucleus``): no row needs the scan
        total = torch.zeros(n_rows, dtype=torch.float64, device=probs.device)
    rows = torch.arange(n_rows, device=probs.device)
    flat_ids, kept_vals = [], []
    for candidates in (*_CANDIDATES, vocab):
        width = min(vocab, max(candidates, max(top_k) + 1))
        vals, ids = _most_probable(probs if len(rows) == n_rows else probs[rows], width)
        kept, decided = _nucleus(vals, k[rows], p[rows], total[rows], whole_row=width == vocab)
        kept = (vals * kept).double()
        flat_ids.append((ids + (rows * vocab).unsqueeze(-1))[decided].flatten())
        kept_vals.append((kept / kept.cumsum(dim=-1)[:, -1:]).float()[decided].flatten())
        rows = rows[~decided]
        if not rows.numel():
            break
    flat = probs.view(-1)
    flat.zero_()
    flat[torch.cat(flat_ids)] = torch.cat(kept_vals)
    return probs


def _most_probable(probs: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, ids) [R, width]``: each row's ``width`` most probable tokens in rank order (ties: lower id
    first). Among tokens tied with the last one, which make it in is unspecified below the whole row."""
    if width == probs.shape[-1]:
        return torch.sort(probs, dim=-1, descending=True, stable=True)
    vals, ids = torch.topk(probs, width, dim=-1)  # ties in any order
    ids, by_id = ids.sort(dim=-1)
    vals = vals.gather(-1, by_id)
    ranked = vals.sort(dim=-1, descending=True, stable=True).indices
    return vals.gather(-1, ranked), ids.gather(-1, ranked)


def _nucleus(ranked: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, total: torch.Tensor, whole_row: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kept [R, W] bool, decided [R] bool)`` for rows' W most probable tokens ``ranked`` in rank order.

    ``kept``: the ranks top-k then top-p keep (``total``: each row's mass, used where ``top_k`` is 0).
    ``decided``: whether those W ranks settle the row exactly as its whole sorted row would (always, with
    ``whole_row``): under top-k, when the k-th probability is not tied with the next one (the top-k set and
    its mass are then the W ranks' own); under top-p alone, when the last kept probability exceeds the W-th
    (every token at least as probable as the kept ones is then among the W, in its rank).
    """
    width = ranked.shape[-1]
    rank = torch.arange(width, device=ranked.device)
    in_k = (top_k == 0).unsqueeze(-1) | (rank < top_k.unsqueeze(-1))
    mass = (ranked * in_k).double().cumsum(dim=-1)
    total = torch.where(top_k > 0, mass[:, -1], total)
    before = torch.cat([torch.zeros_like(mass[:, :1]), mass[:, :-1]], dim=-1)
    kept = in_k & (before < (top_p * total).unsqueeze(-1))
    if whole_row:
        return kept, torch.ones_like(top_k, dtype=torch.bool)
    at_k = top_k.clamp(min=1, max=width - 1).unsqueeze(-1)
    untied_k = ranked.gather(-1, at_k - 1).squeeze(-1) > ranked.gather(-1, at_k).squeeze(-1)
    last_kept = ranked.gather(-1, (kept.sum(dim=-1, keepdim=True) - 1)).squeeze(-1)
    return kept, torch.where(top_k > 0, untied_k, last_kept > ranked[:, -1])


def _uniforms(generators: Sequence[torch.Generator], count: int, used: Sequence[int] | None = None) -> torch.Tensor:
    """``[len(generators), count]`` float64 uniforms in [0, 1): row n holds ``used[n]`` (default ``count``)
    drawn from its generator, exactly that many, then zeros."""
    out = torch.zeros((len(generators), count), dtype=torch.float64)
    for row, g in enumerate(generators):
        n = count if used is None else used[row]
        out[row, :n] = torch.rand(n, generator=g, dtype=torch.float64)
    return out


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from each row of ``probs [N, V]`` (normalized on the fly) with uniforms ``u [N]``.

    Never returns a zero-probability token: the search picks the first index whose CDF exceeds ``u *
    total`` (zero-probability tokens never increase the CDF), and rounding past the end is clamped to the
    last token with nonzero probability.
    """
    if probs.shape[0] == 0:
        return torch.empty(0, dtype=torch.long, device=probs.device)
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1]
    if not bool((total > 0).all()) or not bool(torch.isfinite(total).all()):
        raise ValueError("every row must have positive, finite probability mass")
    target = (u.to(device=probs.device, dtype=torch.float64) * total).unsqueeze(-1).contiguous()
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    vocab = probs.shape[-1]
    last_nonzero = (vocab - 1) - (probs.flip(-1) > 0).to(torch.uint8).argmax(dim=-1)
    return torch.minimum(idx, last_nonzero)


def sample(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Draw one token id per row of ``probs [N, V]`` -> ``[N]`` int64, by inverse CDF.

    Consumes exactly one float64 uniform from each row's generator (``generators[n]`` for row ``n``), so
    a row's draw depends only on its own probabilities and generator. Never returns a token whose
    probability is zero; rows are renormalized implicitly.
    """
    if probs.ndim != 2:
        raise ValueError(f"probs must be [N, V], got shape {tuple(probs.shape)}")
    if len(generators) != probs.shape[0]:
        raise ValueError(f"need one generator per row: {len(generators)} for {probs.shape[0]} rows")
    u = _uniforms(generators, 1).squeeze(-1)
    return _inverse_cdf(probs, u)


@dataclass(frozen=True)
class CompactDistribution:
    """A sparse draft distribution as sent over the wire: token ids and their fp16 probabilities."""

    token_ids: np.ndarray  # int32 [S]
    probs_fp16: bytes  # little-endian float16 [S]

    def relabeled(self, ids: np.ndarray) -> CompactDistribution:
        """The same probabilities on ``ids[t]`` for each token id t (e.g. a draft's own rows to the target's ids);
        ``ids`` must be one-to-one."""
        return CompactDistribution(token_ids=ids[self.token_ids].astype(np.int32), probs_fp16=self.probs_fp16)

    def to_dense(self, vocab_size: int) -> torch.Tensor:
        """Return the encoded distribution as a dense float32 ``[vocab_size]`` tensor summing to 1.

        Deterministic: the same bytes always give the same bits (renormalization in float64, then a single
        rounding to float32), so the draft samples from and the target verifies against the same ``q``.
        """
        ids = np.asarray(self.token_ids, dtype=np.int64)
        vals = np.frombuffer(self.probs_fp16, dtype=_FP16_LE).astype(np.float64)
        if ids.ndim != 1 or ids.shape != vals.shape:
            raise InvalidInput(f"compact distribution has {ids.size} token ids but {vals.size} probabilities")
        if ids.size == 0:
            raise InvalidInput("compact distribution is empty")
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise InvalidInput(f"compact distribution token id out of range [0, {vocab_size})")
        if np.unique(ids).size != ids.size:
            raise InvalidInput("compact distribution has duplicate token ids")
        if not np.isfinite(vals).all() or (vals < 0).any():
            raise InvalidInput("compact distribution probabilities must be finite and >= 0")
        total = vals.sum()
        if not total > 0:
            raise InvalidInput("compact distribution has zero mass")
        dense = np.zeros(vocab_size, dtype=np.float32)
        dense[ids] = (vals / total).astype(np.float32)
        return torch.from_numpy(dense)


def compact_distribution(
    probs: torch.Tensor, max_support: int = 256, min_prob: float = 1e-4
) -> CompactDistribution:
    """Encode ``probs [V]`` compactly: the at most ``max_support`` most probable tokens with
    probability ``>= min_prob`` (the top-1 token is always kept), probabilities quantized to fp16.

    The result is a valid (possibly truncated) distribution: entries that quantize to 0 are dropped, so
    every transmitted token has positive probability in ``to_dense()``. 6 bytes per kept token.
    """
    if probs.ndim != 1:
        raise ValueError(f"probs must be [V], got shape {tuple(probs.shape)}")
    if max_support < 1:
        raise ValueError(f"max_support must be >= 1, got {max_support}")
    if not min_prob >= 0:
        raise ValueError(f"min_prob must be >= 0, got {min_prob}")
    k = min(max_support, probs.shape[0])
    top_vals, top_ids = torch.topk(probs.detach().float().cpu(), k, sorted=True)
    vals = top_vals.numpy().astype(np.float64)
    ids = top_ids.numpy().astype(np.int32)
    keep = vals >= min_prob
    keep[0] = True
    half = vals[keep].astype(_FP16_LE)
    ids = ids[keep]
    nonzero = half > 0
    if not nonzero.any():
        raise ValueError("distribution has no token with positive probability")
    return CompactDistribution(token_ids=ids[nonzero].copy(), probs_fp16=half[nonzero].tobytes())


def point_distribution(token_id: int) -> CompactDistribution:
    """The distribution that puts all mass on ``token_id``: ``q`` of a deterministic proposal (prompt lookup).

    Verified against it, the token is accepted with probability ``p(token_id)`` and a rejection draws from
    ``p`` without that token, so the output still has exactly the target's distribution.
    """
    return CompactDistribution(token_ids=np.array([token_id], dtype=np.int32),
                               probs_fp16=np.array([1.0], dtype=_FP16_LE).tobytes())


def draft_distribution(probs: torch.Tensor, greedy: bool) -> tuple[torch.Tensor, CompactDistribution | None]:
    """Return ``(q, compact)`` for one processed draft distribution ``probs [V]``.

    Greedy: ``(probs, None)`` (nothing is transmitted). Sampling: ``compact = compact_distribution(probs)``
    and ``q = compact.to_dense(V)`` on ``probs``' device -- the draft must sample its proposal from this
    ``q``, the exact distribution the target will reconstruct.
    """
    if greedy:
        return probs, None
    compact = compact_distribution(probs)
    return compact.to_dense(probs.shape[-1]).to(probs.device), compact


def greedy_accept(top: torch.Tensor, draft_tokens: torch.Tensor, draft_lens: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification; returns ``(accepted_len [B], next_token [B])`` int64 on ``top``'s device.

    ``top [B, K+1]``: the target's argmax token at each window position (position ``i`` predicts draft token
    ``i``); ``draft_tokens [B, K]`` padded, ``draft_lens [B]`` in ``[0, K]``. A row accepts the longest
    prefix of its ``k_b`` draft tokens that equals the argmax and emits the argmax after it. Equal to
    ``verify_proposals`` on the one-hot greedy distributions of ``process_logits``, without building them.
    """
    k_max = top.shape[1] - 1
    device = top.device
    lens = draft_lens.to(device=device, dtype=torch.long)
    valid = torch.arange(k_max, device=device).unsqueeze(0) < lens.unsqueeze(-1)
    accept = valid & (draft_tokens.to(device=device, dtype=torch.long) == top[:, :k_max])
    accepted_len = accept.long().cumprod(dim=-1).sum(dim=-1)
    return accepted_len, top.gather(1, accepted_len.unsqueeze(-1)).squeeze(-1)


WindowDistributions = Callable[[torch.Tensor, int], torch.Tensor]
"""``(rows, position) -> [len(rows), V]`` float32: the distributions of the batch rows ``rows`` (int64, on the
host) at one window position. ``verify_windows`` asks only for the positions a row reaches."""


def verify_proposals(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_lens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: torch.Tensor,
    generators: Sequence[torch.Generator],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decide a batch of speculative proposals from dense distributions; return ``(accepted_len [B], next_token
    [B])`` int64 on ``target_probs``' device. ``verify_windows`` with the distributions built already.

    ``target_probs [B, K+1, V]``: processed target distributions (position ``i`` predicts draft token
    ``i``, position ``K`` is the bonus). ``draft_tokens [B, K]`` padded, ``draft_lens [B]`` with
    ``0 <= k_b <= K``; positions ``>= k_b`` are ignored. ``draft_probs [B, K, V]``: the dense ``q`` each
    draft token was drawn from (ignored for greedy rows; may be ``None`` if no sampling row proposes).
    """
    if target_probs.ndim != 3:
        raise ValueError(f"target_probs must be [B, K+1, V], got shape {tuple(target_probs.shape)}")
    batch, window, vocab = target_probs.shape
    if window < 1:
        raise ValueError("target_probs needs at least one window position")
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, window - 1, vocab):
        raise ValueError(f"draft_probs must be [{batch}, {window - 1}, {vocab}], got {tuple(draft_probs.shape)}")
    if tuple(draft_tokens.shape) != (batch, window - 1):
        raise ValueError(f"draft_tokens must be [{batch}, {window - 1}], got {tuple(draft_tokens.shape)}")

    def rows_of(probs: torch.Tensor) -> WindowDistributions:
        return lambda rows, position: probs[rows.to(probs.device), position]

    accepted, next_token = verify_windows(rows_of(target_probs), None if draft_probs is None else rows_of(draft_probs),
                                          draft_tokens, draft_lens, greedy, generators, vocab)
    return accepted.to(target_probs.device), next_token.to(target_probs.device)


def verify_windows(
    target_probs: WindowDistributions,
    draft_probs: WindowDistributions | None,
    draft_tokens: torch.Tensor,
    draft_lens: torch.Tensor,
    greedy: torch.Tensor,
    generators: Sequence[torch.Generator],
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decide a batch of speculative proposals; return ``(accepted_len [B], next_token [B])`` int64 on the host.

    ``target_probs(rows, i)``: the rows' processed target distributions at window position ``i`` (position
    ``i`` predicts draft token ``i``, position ``k_b`` is row b's bonus); ``draft_probs(rows, i)``: the dense
    ``q`` their draft token ``i`` was drawn from (unused for greedy rows; may be ``None`` if no sampling row
    proposes). ``draft_tokens [B, K]`` padded, ``draft_lens [B]`` with ``0 <= k_b <= K``; positions ``>= k_b``
    are ignored.

    Greedy rows accept the longest prefix matching the target argmax and emit the argmax at the first
    mismatch (or at ``k_b``). Sampling rows use the lossless rule: accept ``x_i`` iff
    ``u_i < p_i(x_i) / q_i(x_i)`` (never if ``q_i(x_i) == 0``), then emit a token from the residual
    ``norm(max(0, p_j - q_j))`` at the first rejection ``j`` or from ``p_{k_b}`` if all were accepted; the
    emitted tokens are then distributed exactly as the target's processed distributions. A sampling row's
    distributions are asked for position by position up to where it stops (its first rejection or its bonus),
    never beyond: what the test decides does not depend on later positions. Each sampling row consumes exactly
    ``k_b + 1`` uniforms from its own generator per call (the first for the emitted token, the next ``k_b`` for
    the acceptance tests), so its outcome and its generator's state depend on its own proposal only, not on
    the other rows of the batch; greedy rows consume none. ``0 <= accepted_len <= k_b``.
    """
    batch, k_max = draft_tokens.shape
    if tuple(draft_lens.shape) != (batch,) or tuple(greedy.shape) != (batch,):
        raise ValueError(f"draft_lens and greedy must be [{batch}]")
    if len(generators) != batch:
        raise ValueError(f"need one generator per row: {len(generators)} for {batch} rows")
    lens = draft_lens.to(device="cpu", dtype=torch.long)
    if bool(((lens < 0) | (lens > k_max)).any()):
        raise ValueError(f"draft_lens must be in [0, {k_max}]")
    valid = torch.arange(k_max).unsqueeze(0) < lens.unsqueeze(-1)  # [B, K]
    tokens = torch.where(valid, draft_tokens.to(device="cpu", dtype=torch.long), 0)
    if bool(((tokens < 0) | (tokens >= vocab_size)).any()):
        raise ValueError(f"draft token id out of range [0, {vocab_size})")
    is_greedy = greedy.to(device="cpu", dtype=torch.bool)
    accepted = torch.zeros(batch, dtype=torch.long)
    next_token = torch.zeros(batch, dtype=torch.long)
    g_rows = is_greedy.nonzero().squeeze(-1)
    if g_rows.numel():
        top = torch.stack([target_probs(g_rows, i).argmax(dim=-1).cpu() for i in range(k_max + 1)], dim=1)
        accepted[g_rows], next_token[g_rows] = greedy_accept(top, tokens[g_rows], lens[g_rows])
    live = (~is_greedy).nonzero().squeeze(-1)  # sampling rows that accepted every token so far
    if not live.numel():
        return accepted, next_token
    if draft_probs is None and bool((lens[live] > 0).any()):
        raise ValueError("draft_probs is required when a sampling row proposes tokens")
    u = torch.zeros((batch, k_max + 1), dtype=torch.float64)
    u[live] = _uniforms([generators[b] for b in live.tolist()], k_max + 1, (lens[live] + 1).tolist())
    for position in range(k_max + 1):
        p = target_probs(live, position)  # [L, V]
        proposes = lens[live] > position
        stops = ~proposes
        if bool(proposes.any()):
            assert draft_probs is not None
            testing = live[proposes]
            q = draft_probs(testing, position).to(p.device)
            x = tokens[testing, position].to(p.device).unsqueeze(-1)
            p_x = p[proposes.to(p.device)].gather(-1, x).squeeze(-1).double()
            q_x = q.gather(-1, x).squeeze(-1).double()
            # u < min(1, p/q) with u in [0, 1) is u < p/q; written as u * q < p to avoid dividing.
            taken = ((q_x > 0) & (u[testing, position + 1].to(p.device) * q_x < p_x)).cpu()
            rejected = proposes.nonzero().squeeze(-1)[~taken]
            if rejected.numel():
                p = p.clone()
                p[rejected.to(p.device)] = _residual(p[rejected.to(p.device)], q[~taken.to(p.device)])
                stops[rejected] = True
        ending = live[stops]
        accepted[ending] = position
        next_token[ending] = _inverse_cdf(p[stops.to(p.device)], u[ending, 0]).cpu()
        live = live[~stops]
        if not live.numel():
            break
    return accepted, next_token


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution to draw from after a rejection (rows ``[S, V]``, unnormalized): ``max(0, p - q)``, or
    ``p`` where that has no mass (``p == q`` numerically)."""
    residual = (p - q).clamp_min(0.0)
    return torch.where((residual.double().sum(dim=-1) > 0).unsqueeze(-1), residual, p)
