"""One decode step (W=1) of a small MHA Llama-like decoder: bifurcated vs expanded (standard) KV cache.

The model has random weights: token embedding, then per layer RMSNorm, fused QKV projection, RoPE,
attention, output projection, RMSNorm and a SiLU-gated MLP; then a final RMSNorm and the LM head. For each
(samples n, context L) one group of n samples shares a prompt of L tokens whose KV is already cached, each
sample has ``--decode-len`` decode tokens cached, and the step appends one token per sample (writing its
K/V into the cache) and returns the logits. The bifurcated layout keeps the prompt KV once per layer; the
standard layout holds one copy per sample and runs SDPA over it. Medians of interleaved repeats, their
ratio and the KV bytes of both layouts are reported; ``--plot`` draws latency vs n, one line per context.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from bench.arguments import int_list
from bench.timing import expanded_baseline, format_bytes, host_info, kernel_setup, time_interleaved

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the options of ``specserve bench decode``."""
    parser.add_argument("--samples", type=int_list, default=[1, 4, 16, 32], help="comma-separated n values")
    parser.add_argument("--context", type=int_list, default=[1024, 4096, 8192],
                        help="comma-separated prompt lengths")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16, help="attention heads (MHA: kv heads = heads)")
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 2.75 x hidden)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--decode-len", type=int, default=16, help="decode tokens already cached per sample")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--backend", choices=["torch", "triton"], default=None,
                        help="bifurcated backend (default: triton with CUDA, else torch)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--max-kv-gib", type=float, default=12.0,
                        help="skip points whose expanded KV cache would exceed this many GiB")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--plot", default=None, help="write a PNG plot (latency vs n) to this path")


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension (computed in fp32, returned in x's dtype)."""
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (rotate-half form) of x [B, H, 1, Dh] at per-row positions [B]."""
    dim = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [B, Dh/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, None, :].to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, None, :].to(x.dtype)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DecoderLayer(nn.Module):
    """Llama-like pre-norm decoder layer (MHA) for a one-token decode step."""

    def __init__(self, hidden: int, heads: int, intermediate: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.attn_norm = RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = RMSNorm(hidden)
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, layer: int, attend: AttendFn) -> torch.Tensor:
        """x [B, 1, hidden] -> [B, 1, hidden]; ``attend(layer, q, k, v)`` stores k/v and returns attention."""
        batch = x.shape[0]
        qkv = self.qkv(self.attn_norm(x)).view(batch, 1, 3, self.heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # each [B, H, 1, Dh]
        q, k = apply_rope(q, positions), apply_rope(k, positions)
        o = attend(layer, q, k, v)  # [B, H, 1, Dh]
        x = x + self.o_proj(o.transpose(1, 2).reshape(batch, 1, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class TinyLlama(nn.Module):
    """Embedding, decoder layers, final norm and LM head; ``step`` runs one decode step."""

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, intermediate: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(DecoderLayer(hidden, heads, intermediate) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """One decode step of tokens [B] at positions [B]; returns the logits [B, vocab]."""
        x = self.embed(tokens)[:, None, :]
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, i, attend)
        return self.lm_head(self.norm(x))[:, 0]


@dataclass
class BifurcatedCache:
    """Per layer: the shared prompt KV [H, L, Dh] once, and per-sample decode caches [B, H, C, Dh]."""

    prefix_k: list[torch.Tensor]
    prefix_v: list[torch.Tensor]
    decode_k: list[torch.Tensor]
    decode_v: list[torch.Tensor]
    base: torch.Tensor  # [B] decode tokens before the new one
    attention: Callable[..., torch.Tensor]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write the new k/v at slot ``base`` of each row, then bifurcated attention over prompt + decode."""
        rows = torch.arange(q.shape[0], device=q.device)
        self.decode_k[layer][rows, :, self.base] = k[:, :, 0]
        self.decode_v[layer][rows, :, self.base] = v[:, :, 0]
        ctx = self.prefix_k[layer].shape[1]
        return self.attention(
            q, self.prefix_k[layer], self.prefix_v[layer], [0, ctx], [0, q.shape[0]],
            self.decode_k[layer], self.decode_v[layer], self.base, self.base + 1, q.shape[-1] ** -0.5,
        )


@dataclass
class ExpandedCache:
    """Per layer: one cache [B, H, L + C, Dh] per sample holding a copy of the prompt KV (standard)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    base: torch.Tensor  # [B] = L + decode tokens before the new one
    attention: Callable[..., torch.Tensor]  # bench.timing.expanded_baseline

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write the new k/v at slot ``base`` of each row, then SDPA over the row's whole cache."""
        rows = torch.arange(q.shape[0], device=q.device)
        self.k[layer][rows, :, self.base] = k[:, :, 0]
        self.v[layer][rows, :, self.base] = v[:, :, 0]
        scale = q.shape[-1] ** -0.5
        return self.attention(q, self.k[layer], self.v[layer], self.base, self.base + 1, scale)


def run_point(
    model: TinyLlama, n: int, ctx: int, args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
    attention: Callable[..., torch.Tensor],
) -> dict[str, object]:
    """Time one (n, context) point: both layouts on the same prompt/decode KV and the same tokens."""
    from kernels.bifurcated import kv_cache_bytes
    from kernels.standard import expand_bifurcated_kv

    heads, dim, layers = args.heads, args.hidden // args.heads, args.layers
    gen = torch.Generator().manual_seed(args.seed + 1000 * n + ctx)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    capacity = args.decode_len + 1
    base = torch.full((n,), args.decode_len, dtype=torch.int64, device=device)
    bif = BifurcatedCache(
        prefix_k=[rnd(heads, ctx, dim) for _ in range(layers)],
        prefix_v=[rnd(heads, ctx, dim) for _ in range(layers)],
        decode_k=[rnd(n, heads, capacity, dim) for _ in range(layers)],
        decode_v=[rnd(n, heads, capacity, dim) for _ in range(layers)],
        base=base, attention=attention,
    )
    exp_k, exp_v = [], []
    for i in range(layers):
        k, v, base_exp, _ = expand_bifurcated_kv(
            bif.prefix_k[i], bif.prefix_v[i], [0, ctx], [0, n],
            bif.decode_k[i], bif.decode_v[i], base, base + 1,
        )
        exp_k.append(k)
        exp_v.append(v)
    std = ExpandedCache(k=exp_k, v=exp_v, base=base_exp, attention=expanded_baseline(device)[1])
    tokens = torch.randint(0, args.vocab, (n,), generator=gen).to(device)
    positions = ctx + base

    def bifurcated() -> torch.Tensor:
        return model.step(tokens, positions, bif.attend)

    def standard() -> torch.Tensor:
        return model.step(tokens, positions, std.attend)

    err = (bifurcated().float() - standard().float()).abs().max().item()
    medians = time_interleaved({"bifurcated": bifurcated, "standard": standard}, args.repeats, args.warmup)
    elem = torch.tensor([], dtype=dtype).element_size()
    return {
        "samples": n, "context": ctx,
        "median_s": medians,
        "ratio_standard_over_bifurcated": medians["standard"] / medians["bifurcated"],
        "max_abs_logit_err": err,
        "kv_bytes": kv_cache_bytes([ctx], [n], capacity, heads, dim, elem, layers),
    }


def run_decode_bench(args: argparse.Namespace) -> dict[str, object]:
    """Run every (n, context) point of ``args`` and return the result record (medians in seconds)."""
    device, backend = kernel_setup(args.threads, args.device, args.backend)
    from kernels import get_bifurcated_attention
    from kernels.bifurcated import kv_cache_bytes

    if args.hidden % args.heads:
        raise SystemExit("--hidden must be a multiple of --heads")
    dtype = DTYPES[args.dtype]
    intermediate = args.intermediate or int(math.ceil(2.75 * args.hidden / 256) * 256)
    torch.manual_seed(args.seed)
    model = TinyLlama(args.vocab, args.hidden, args.layers, args.heads, intermediate)
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.normal_(p, std=0.02)
    model = model.to(device=device, dtype=dtype).eval()
    attention = get_bifurcated_attention(backend)
    elem = torch.tensor([], dtype=dtype).element_size()
    points, skipped = [], []
    with torch.inference_mode():
        for ctx in args.context:
            for n in args.samples:
                need = kv_cache_bytes([ctx], [n], args.decode_len + 1, args.heads, args.hidden // args.heads,
                                      elem, args.layers)
                if need["standard"] / 2**30 > args.max_kv_gib:
                    skipped.append({"samples": n, "context": ctx, "standard_kv_bytes": need["standard"]})
                    continue
                points.append(run_point(model, n, ctx, args, device, dtype, attention))
                gc.collect()
    return {
        "benchmark": "decode",
        "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                  "head_dim": args.hidden // args.heads, "intermediate": intermediate, "vocab": args.vocab,
                  "parameters": sum(p.numel() for p in model.parameters())},
        "dtype": args.dtype, "backend": backend, "baseline": expanded_baseline(device)[0], "device": str(device),
        "decode_len": args.decode_len,
        "repeats": args.repeats, "warmup": args.warmup,
        "points": points, "skipped": skipped,
        "host": host_info(),
    }


def plot_results(res: dict[str, object], path: str) -> None:
    """Write a PNG: decode-step latency vs n (one color per context; solid bifurcated, dashed standard)
    and the standard/bifurcated ratio vs n."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = res["points"]
    contexts = sorted({p["context"] for p in points})
    fig, (ax, ax_ratio) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, ctx in enumerate(contexts):
        pts = sorted((p for p in points if p["context"] == ctx), key=lambda p: p["samples"])
        ns = [p["samples"] for p in pts]
        color = f"C{i}"
        ax.plot(ns, [p["median_s"]["bifurcated"] * 1e3 for p in pts], "o-", color=color,
                label=f"bifurcated, L={ctx}")
        ax.plot(ns, [p["median_s"]["standard"] * 1e3 for p in pts], "s--", color=color,
                label=f"standard, L={ctx}")
        ax_ratio.plot(ns, [p["ratio_standard_over_bifurcated"] for p in pts], "o-", color=color,
                      label=f"L={ctx}")
    model = res["model"]
    for a in (ax, ax_ratio):
        a.set_xscale("log", base=2)
        a.set_xlabel("samples n (sharing one prompt)")
        a.grid(True, which="both", alpha=0.3)
    ax.set_yscale("log")
    ax.set_ylabel("decode step latency, median (ms)")
    threads = res.get("host", {}).get("torch_threads", "?")
    ax.set_title(f"decode step: {model['layers']} layers, hidden {model['hidden']}, "
                 f"{res['dtype']}, {res['device']}, {threads} thread(s)", fontsize=10)
    ax.legend(fontsize=7)
    ax_ratio.axhline(1.0, color="gray", lw=0.8)
    ax_ratio.set_ylabel("standard / bifurcated")
    ax_ratio.set_title("speed-up of bifurcated attention")
    ax_ratio.legend(fontsize=8)
    fig.tight_layout()
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """``specserve bench decode``: print a table (or ``--json``), optionally write the ``--plot`` PNG."""
    res = run_decode_bench(args)
    if args.plot:
        plot_results(res, args.plot)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    model = res["model"]
    print(f"decode step: layers={model['layers']} hidden={model['hidden']} heads={model['heads']} "
          f"vocab={model['vocab']} dtype={res['dtype']} backend={res['backend']} device={res['device']} "
          f"repeats={res['repeats']}")
    print(f"{'n':>4}{'context':>9}{'bifurcated ms':>15}{'standard ms':>13}{'ratio':>8}"
          f"{'KV bifurcated':>15}{'KV standard':>14}")
    for p in res["points"]:
        med, kv = p["median_s"], p["kv_bytes"]
        print(f"{p['samples']:>4}{p['context']:>9}{med['bifurcated'] * 1e3:>15.2f}"
              f"{med['standard'] * 1e3:>13.2f}"
              f"{p['ratio_standard_over_bifurcated']:>7.2f}x{format_bytes(kv['bifurcated']):>15}"
              f"{format_bytes(kv['standard']):>14}")
    for s in res["skipped"]:
        print(f"skipped n={s['samples']} context={s['context']}: expanded KV "
              f"{format_bytes(s['standard_kv_bytes'])} > --max-kv-gib")
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0
