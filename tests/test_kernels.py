"""Bifurcated attention (torch and Triton) against SDPA on the expanded KV layout.

The Triton kernels run on CPU through the Triton interpreter: ``TRITON_INTERPRET=1`` is set below before
triton is imported (only when no CUDA device is present), and shapes are kept tiny.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import ATTENTION_BACKENDS, get_bifurcated_attention, get_cascade_attention  # noqa: E402
from kernels.bifurcated import (  # noqa: E402
    bifurcated_attention,
    context_attention,
    decode_attention,
    kv_cache_bytes,
    merge_attention_states,
)
from kernels.cascade import ContextLevel, cascade_attention, disjoint_tiers  # noqa: E402
from kernels.standard import expand_bifurcated_kv, standard_attention  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


@dataclass
class Case:
    """One bifurcated-layout input set."""

    q: torch.Tensor
    prefix_k: torch.Tensor
    prefix_v: torch.Tensor
    prefix_offsets: list[int]
    group_offsets: list[int]
    decode_k: torch.Tensor
    decode_v: torch.Tensor
    decode_base: torch.Tensor
    decode_lens: torch.Tensor
    scale: float

    def args(self) -> tuple:
        return (
            self.q, self.prefix_k, self.prefix_v, self.prefix_offsets, self.group_offsets,
            self.decode_k, self.decode_v, self.decode_base, self.decode_lens, self.scale,
        )


def make_case(
    *,
    kv_heads: int,
    ratio: int,
    window: int,
    prefix_lens: tuple[int, ...] = (1, 9, 23),
    samples: tuple[int, ...] = (1, 3, 8),
    head_dim: int = 16,
    capacity: int = 13,
    dtype: torch.dtype = torch.float32,
    empty_decode: bool = False,
    seed: int = 0,
    device: str = "cpu",
) -> Case:
    """Random case: groups with the given prefix lengths / sample counts, ragged decode bases (incl. 0)."""
    gen = torch.Generator().manual_seed(seed)
    prefix_offsets, group_offsets = [0], [0]
    for p, n in zip(prefix_lens, samples, strict=True):
        prefix_offsets.append(prefix_offsets[-1] + p)
        group_offsets.append(group_offsets[-1] + n)
    batch, ptot, hq = group_offsets[-1], prefix_offsets[-1], kv_heads * ratio

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    if empty_decode:
        base = torch.zeros(batch, dtype=torch.int64)
        lens = torch.zeros(batch, dtype=torch.int64)
    else:
        base = torch.randint(0, capacity - window + 1, (batch,), generator=gen)
        base[0] = 0
        base[-1] = capacity - window  # a full cache
        # this row's window length: W for most rows, shorter (padded queries) for some when W > 1
        lens = base + torch.where(torch.rand(batch, generator=gen) < 0.7, window,
                                  torch.randint(1, window + 1, (batch,), generator=gen))
    return Case(
        q=rnd(batch, hq, window, head_dim),
        prefix_k=rnd(kv_heads, ptot, head_dim),
        prefix_v=rnd(kv_heads, ptot, head_dim),
        prefix_offsets=prefix_offsets,
        group_offsets=group_offsets,
        decode_k=rnd(batch, kv_heads, capacity, head_dim),
        decode_v=rnd(batch, kv_heads, capacity, head_dim),
        decode_base=base.to(device),
        decode_lens=lens.to(device),
        scale=head_dim**-0.5,
    )


def sdpa_reference(case: Case) -> torch.Tensor:
    """Oracle, independent from the code under test: per row, SDPA (fp32) over concat(prefix, decode KV)
    with K/V repeat_interleaved to the query heads and the causal-window mask on the decode keys."""
    batch, hq, window, _ = case.q.shape
    hkv = case.prefix_k.shape[0]
    out = torch.empty(case.q.shape, dtype=torch.float32)
    groups = len(case.group_offsets) - 1
    for g in range(groups):
        plo, phi = case.prefix_offsets[g], case.prefix_offsets[g + 1]
        for b in range(case.group_offsets[g], case.group_offsets[g + 1]):
            dec = int(case.decode_lens[b])
            k = torch.cat([case.prefix_k[:, plo:phi], case.decode_k[b, :, :dec]], dim=1).float().cpu()
            v = torch.cat([case.prefix_v[:, plo:phi], case.decode_v[b, :, :dec]], dim=1).float().cpu()
            k = k.repeat_interleave(hq // hkv, dim=0)
            v = v.repeat_interleave(hq // hkv, dim=0)
            mask = torch.ones(window, phi - plo + dec, dtype=torch.bool)
            for i in range(window):
                visible = min(int(case.decode_base[b]) + i + 1, dec)
                mask[i, phi - plo + visible :] = False
            out[b] = F.scaled_dot_product_attention(
                case.q[b].float().cpu(), k, v, attn_mask=mask, scale=case.scale
            )
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.shape == expected.shape
    err = (actual.float().cpu() - expected.float().cpu()).abs().max().item()
    assert err <= TOL[dtype], f"max abs error {err} > {TOL[dtype]}"


# (kv_heads, ratio): MHA r=1, GQA r=4, GQA r=8, MQA (one kv head).
HEAD_LAYOUTS = [(3, 1), (2, 4), (2, 8), (1, 6)]


@pytest.mark.parametrize("kv_heads,ratio", HEAD_LAYOUTS)
@pytest.mark.parametrize("window", [1, 5])
def test_torch_matches_sdpa_fp32(kv_heads: int, ratio: int, window: int) -> None:
    case = make_case(kv_heads=kv_heads, ratio=ratio, window=window, seed=kv_heads * 10 + ratio + window)
    out = bifurcated_attention(*case.args())
    assert out.dtype == torch.float32
    assert_close(out, sdpa_reference(case), torch.float32)


@pytest.mark.parametrize("kv_heads,ratio", HEAD_LAYOUTS)
def test_torch_context_only_when_decode_empty(kv_heads: int, ratio: int) -> None:
    case = make_case(kv_heads=kv_heads, ratio=ratio, window=1, empty_decode=True, seed=7)
    out = bifurcated_attention(*case.args())
    assert_close(out, sdpa_reference(case), torch.float32)
    o_dec, lse_dec = decode_attention(
        case.q, case.decode_k, case.decode_v, case.decode_base, case.decode_lens, case.scale
    )
    assert torch.isneginf(lse_dec).all() and (o_dec == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [1, 5])
def test_torch_low_precision(dtype: torch.dtype, window: int) -> None:
    case = make_case(kv_heads=2, ratio=4, window=window, dtype=dtype, seed=3)
    out = bifurcated_attention(*case.args())
    assert out.dtype == dtype
    assert_close(out, sdpa_reference(case), dtype)


def test_standard_attention_on_expanded_layout_matches() -> None:
    case = make_case(kv_heads=2, ratio=4, window=5, seed=11)
    k, v, base, lens = expand_bifurcated_kv(
        case.prefix_k, case.prefix_v, case.prefix_offsets, case.group_offsets,
        case.decode_k, case.decode_v, case.decode_base, case.decode_lens,
    )
    assert k.shape[0] == case.q.shape[0]
    std = standard_attention(case.q, k, v, base, lens, case.scale)
    assert_close(std, sdpa_reference(case), torch.float32)
    assert_close(bifurcated_attention(*case.args()), std, torch.float32)


@pytest.mark.parametrize("fused", [False, True], ids=["matmuls", "fused-cpu"])
def test_context_lse_is_logsumexp_of_prefix_scores(fused: bool) -> None:
    case = make_case(kv_heads=2, ratio=4, window=5, seed=5)
    o, lse = context_attention(
        case.q, case.prefix_k, case.prefix_v, case.prefix_offsets, case.group_offsets, case.scale, fused=fused
    )
    g, b = 2, case.group_offsets[2] + 1
    plo, phi = case.prefix_offsets[g], case.prefix_offsets[g + 1]
    k = case.prefix_k[:, plo:phi].repeat_interleave(4, dim=0)
    v = case.prefix_v[:, plo:phi].repeat_interleave(4, dim=0)
    scores = case.q[b] @ k.transpose(-1, -2) * case.scale
    torch.testing.assert_close(lse[b], torch.logsumexp(scores, -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o[b], torch.softmax(scores, -1) @ v, atol=1e-5, rtol=1e-5)


def test_merge_with_one_empty_part() -> None:
    gen = torch.Generator().manual_seed(1)
    o1 = torch.randn(2, 3, 4, 8, generator=gen)
    o2 = torch.randn(2, 3, 4, 8, generator=gen)
    lse1 = torch.randn(2, 3, 4, generator=gen)
    empty = torch.full((2, 3, 4), float("-inf"))
    assert torch.equal(merge_attention_states(o1, lse1, torch.zeros_like(o2), empty), o1)
    assert torch.equal(merge_attention_states(torch.zeros_like(o1), empty, o2, lse1), o2)
    both = merge_attention_states(o1, empty, o2, empty)
    assert torch.equal(both, torch.zeros_like(o1))
    # Two non-empty parts: weights e^lse, including large lse values (stability).
    lse2 = lse1 + 500.0
    merged = merge_attention_states(o1, lse1, o2, lse2)
    w1 = torch.sigmoid(lse1 - lse2)[..., None]
    torch.testing.assert_close(merged, w1 * o1 + (1 - w1) * o2)
    assert torch.isfinite(merged).all()


def test_kv_bytes_report_n_fold_prompt_reduction() -> None:
    for n in (1, 4, 32):
        b = kv_cache_bytes([8192], [n], decode_len=16, kv_heads=32, head_dim=128, element_size=4, layers=2)
        assert b["prompt_standard"] == n * b["prompt_bifurcated"]
        assert b["prompt_bifurcated"] == 8192 * 2 * 32 * 128 * 4 * 2
        assert b["decode"] == n * 16 * 2 * 32 * 128 * 4 * 2
        assert b["standard"] - b["bifurcated"] == (n - 1) * b["prompt_bifurcated"]
    mixed = kv_cache_bytes([10, 3], [4, 2], decode_len=0, kv_heads=1, head_dim=1, element_size=1)
    assert mixed["prompt_bifurcated"] == 2 * 13 and mixed["prompt_standard"] == 2 * (40 + 6)


def test_backend_registry() -> None:
    assert set(ATTENTION_BACKENDS) == {"torch", "triton"}
    assert get_bifurcated_attention("torch") is bifurcated_attention
    assert get_cascade_attention("torch") is cascade_attention
    for get in (get_bifurcated_attention, get_cascade_attention):
        with pytest.raises(ValueError):
            get("nope")


# ---------------------------------------------------------------------------------------------- Triton
# The interpreter must be chosen before triton is first imported (triton decorates its own tl.* helpers at
# import time). If something imported triton earlier in this process without TRITON_INTERPRET=1 (e.g.
# transformers via conftest), the Triton tests re-run in a subprocess started with TRITON_INTERPRET=1.


def _triton_in_process() -> bool:
    """True when the Triton kernels can run in this process (CUDA, or the interpreter active)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return True
    import triton.language.standard as tl_standard

    module = importlib.import_module("kernels.bifurcated_triton")
    kernels_ok = "Interpreted" in type(module._cascade_kernel).__name__
    return kernels_ok and "Interpreted" in type(tl_standard.zeros).__name__


def _triton_module():
    """The Triton module, or skip (the subprocess test runs these cases) when it cannot run here."""
    if not _triton_in_process():
        pytest.skip("triton was imported without TRITON_INTERPRET=1; covered by test_triton_in_subprocess")
    return importlib.import_module("kernels.bifurcated_triton")


def test_triton_in_subprocess() -> None:
    """Run the Triton tests in a fresh interpreter-mode process when they cannot run in this one."""
    if _triton_in_process():
        pytest.skip("the Triton tests run in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
         "-k", "test_triton_ and not subprocess"],
        env=env, capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_CASES = [
    # (kv_heads, ratio, window, dtype, empty_decode)
    (2, 4, 5, torch.float32, False),  # GQA, verification window
    (1, 8, 1, torch.float32, True),  # MQA, decode length 0 (context only)
    (2, 1, 5, torch.bfloat16, False),  # MHA, bf16
]


@pytest.mark.parametrize("kv_heads,ratio,window,dtype,empty_decode", TRITON_CASES)
def test_triton_matches_torch_and_sdpa(
    kv_heads: int, ratio: int, window: int, dtype: torch.dtype, empty_decode: bool
) -> None:
    module = _triton_module()
    case = make_case(
        kv_heads=kv_heads, ratio=ratio, window=window, dtype=dtype, empty_decode=empty_decode,
        prefix_lens=(1, 21), samples=(3, 1), capacity=7, seed=ratio + window, device=TRITON_DEVICE,
    )
    out = module.bifurcated_attention_triton(*case.args())
    assert out.dtype == dtype
    assert_close(out, sdpa_reference(case), dtype)
    assert_close(out, bifurcated_attention(*case.args()), dtype)
    assert get_bifurcated_attention("triton") is module.bifurcated_attention_triton


def test_triton_one_launch_tiles_of_many_samples() -> None:
    """The fused launch where one tile of folded rows holds many samples (MHA, W = 1 and 2: 16 and 8 per
    tile) and where a sample spans two tiles (r * W = 24 > 16), with some rows' decode lengths 0."""
    module = _triton_module()
    for kv_heads, ratio, window, seed in ((2, 1, 1, 3), (1, 1, 2, 4), (1, 3, 8, 5)):
        case = make_case(kv_heads=kv_heads, ratio=ratio, window=window, prefix_lens=(5, 18), samples=(19, 2),
                         capacity=9, seed=seed, device=TRITON_DEVICE)
        case.decode_lens[1:4] = case.decode_base[1:4] = 0  # samples that have decoded nothing yet
        out = module.bifurcated_attention_triton(*case.args())
        assert_close(out, sdpa_reference(case), torch.float32)


# ------------------------------------------------------------------------------------------ benchmarks
def test_bench_attention_and_decode_smoke(tmp_path, capsys) -> None:
    """The two benchmark modules run end to end on tiny shapes (JSON output, plot file)."""
    import argparse
    import json

    from bench import attention, decode

    parser = argparse.ArgumentParser()
    attention.add_arguments(parser)
    args = parser.parse_args(["--samples", "3", "--context", "17", "--heads", "4", "--kv-heads", "2",
                              "--head-dim", "16", "--window", "2", "--repeats", "1", "--warmup", "0",
                              "--backend", "torch", "--json"])
    assert attention.run(args) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["max_abs_err"] < 1e-5
    assert res["kv_bytes"]["prompt_standard"] == 3 * res["kv_bytes"]["prompt_bifurcated"]
    assert set(res["median_s"]) == {"bifurcated", "standard"}

    parser = argparse.ArgumentParser()
    decode.add_arguments(parser)
    plot = tmp_path / "decode.png"
    args = parser.parse_args(["--samples", "1,2", "--context", "9", "--hidden", "32", "--layers", "1",
                              "--heads", "2", "--vocab", "50", "--repeats", "1", "--warmup", "0",
                              "--backend", "torch", "--json", "--plot", str(plot)])
    assert decode.run(args) == 0
    res = json.loads(capsys.readouterr().out)
    assert [p["samples"] for p in res["points"]] == [1, 2]
    assert all(p["max_abs_logit_err"] < 1e-4 for p in res["points"])
    assert plot.stat().st_size > 0


# ------------------------------------------------------------------------------- cascade (prefix cache tree)


def cascade_case(device: str, dtype: torch.dtype = torch.float32, views: bool = False
                 ) -> tuple[torch.Tensor, list[ContextLevel], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seven rows under a tree: a root span read by all, a branch span by rows 0-2, another by row 6, two
    groups' own prompt tails (rows 3 and 4); row 5 reads the root only. GQA 2 x 2, window 2. With ``views``
    the levels' KV are strided views (a slice of a longer run, a position-major tensor), as the layout's
    packed prompt tails and the cache's spans are."""
    gen = torch.Generator().manual_seed(11)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    def kv(length: int) -> torch.Tensor:
        if not views:
            return rnd(hkv, length, dim)
        return rnd(hkv, length + 5, dim)[:, 2:2 + length] if length % 2 else rnd(length, hkv, dim).transpose(0, 1)

    hkv, hq, window, dim, rows, capacity = 2, 4, 2, 16, 7, 5
    levels = [ContextLevel(kv(9), kv(9), (0, 9), (0, rows), 0),
              ContextLevel(kv(5), kv(5), (0, 5), (0, 3), 0),
              ContextLevel(kv(6), kv(6), (0, 4, 6), (0, 1, 2), 3),
              ContextLevel(kv(3), kv(3), (0, 3), (0, 1), 6)]
    base = torch.tensor([0, 1, 3, 0, 2, 1, 0], device=device)
    lens = torch.tensor([2, 3, 5, 1, 4, 3, 2], device=device)
    return rnd(rows, hq, window, dim), levels, rnd(rows, hkv, capacity, dim), rnd(rows, hkv, capacity, dim), base, lens


def cascade_reference(q: torch.Tensor, levels: list[ContextLevel], decode_k: torch.Tensor, decode_v: torch.Tensor,
                      base: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Oracle: per row, SDPA over the concatenation of every level segment reaching it and its decode keys."""
    rows, hq, window, _ = q.shape
    out = torch.empty(q.shape, dtype=torch.float32)
    for b in range(rows):
        segments = []
        for level in levels:
            for g in range(len(level.group_offsets) - 1):
                if level.row_lo + level.group_offsets[g] <= b < level.row_lo + level.group_offsets[g + 1]:
                    lo, hi = level.prefix_offsets[g], level.prefix_offsets[g + 1]
                    segments.append((level.k[:, lo:hi], level.v[:, lo:hi]))
        dec = int(lens[b])
        k = torch.cat([s[0] for s in segments] + [decode_k[b, :, :dec]], dim=1).float().cpu()
        v = torch.cat([s[1] for s in segments] + [decode_v[b, :, :dec]], dim=1).float().cpu()
        context = k.shape[1] - dec
        mask = torch.ones(window, k.shape[1], dtype=torch.bool)
        for i in range(window):
            mask[i, context + min(int(base[b]) + i + 1, dec):] = False
        out[b] = F.scaled_dot_product_attention(q[b].float().cpu(), k.repeat_interleave(hq // k.shape[0], dim=0),
                                                v.repeat_interleave(hq // k.shape[0], dim=0), attn_mask=mask,
                                                scale=scale)
    return out


def test_cascade_tiers_never_share_a_row() -> None:
    _, levels, *_ = cascade_case("cpu")
    tiers = disjoint_tiers(levels)
    assert [[(lv.row_lo, lv.row_hi) for lv in tier] for tier in tiers] == [[(0, 7)], [(0, 3), (3, 5), (6, 7)]]


@pytest.mark.parametrize("views", [False, True])
def test_cascade_torch_matches_sdpa(views: bool) -> None:
    q, levels, dk, dv, base, lens = cascade_case("cpu", views=views)
    out = cascade_attention(q, levels, dk, dv, base, lens, 0.25)
    assert_close(out, cascade_reference(q, levels, dk, dv, base, lens, 0.25), torch.float32)


@pytest.mark.parametrize("dtype,views", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)])
def test_triton_cascade_matches_sdpa(dtype: torch.dtype, views: bool) -> None:
    """The one-launch cascade kernel over a tree of levels held in separate, strided tensors."""
    module = _triton_module()
    q, levels, dk, dv, base, lens = cascade_case(TRITON_DEVICE, dtype, views)
    out = module.cascade_attention_triton(q, levels, dk, dv, base, lens, 0.25)
    assert out.dtype == dtype
    assert_close(out, cascade_reference(q, levels, dk, dv, base, lens, 0.25), dtype)
    assert get_cascade_attention("triton") is module.cascade_attention_triton


def test_triton_cascade_plan_is_cached_and_retained() -> None:
    """A repeated launch reuses its tables (nothing copied to the device), and a retainer open around a
    launch keeps them (what a captured CUDA graph replays)."""
    module = _triton_module()
    q, levels, dk, dv, base, lens = cascade_case(TRITON_DEVICE)
    with module.retain_launch_tensors() as first:
        module.cascade_attention_triton(q, levels, dk, dv, base, lens, 0.25)
    with module.retain_launch_tensors() as second:
        module.cascade_attention_triton(q, levels, dk, dv, base, lens, 0.25)
    assert len(first) == 1 and second[0] is first[0]


def test_triton_cascade_rejects_levels_that_do_not_fit() -> None:
    module = _triton_module()
    q, levels, dk, dv, base, lens = cascade_case(TRITON_DEVICE)
    wrong_heads = ContextLevel(levels[0].k[:1], levels[0].v[:1], (0, 9), (0, 7), 0)
    too_many_rows = ContextLevel(levels[0].k, levels[0].v, (0, 9), (0, 8), 0)
    past_its_keys = ContextLevel(levels[0].k, levels[0].v, (0, 10), (0, 7), 0)
    for level in (wrong_heads, too_many_rows, past_its_keys):
        with pytest.raises(ValueError):
            module.cascade_attention_triton(q, [level], dk, dv, base, lens, 0.25)
