"""One attention call: bifurcated attention vs standard attention over the expanded KV cache.

One group: a prompt of ``--context`` tokens shared by ``--samples`` rows, each row with ``--decode-len``
decode tokens and a query window of ``--window`` tokens. The standard path gets the same inputs in the
expanded layout (the prompt KV copied once per sample). Both are timed with interleaved repeats and
reported as medians, with their ratio, their max abs difference and the KV bytes of both layouts.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.timing import expanded_baseline, format_bytes, host_info, kernel_setup, time_interleaved

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the options of ``specserve bench attention``."""
    parser.add_argument("--samples", type=int, default=32, help="n: samples sharing the prompt")
    parser.add_argument("--context", type=int, default=8192, help="prompt (prefix) length L")
    parser.add_argument("--heads", type=int, default=32, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=None, help="kv heads (default: --heads, i.e. MHA)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--window", type=int, default=1, help="query tokens per row (1: decode, k+1: verify)")
    parser.add_argument("--decode-len", type=int, default=16, help="decode tokens already cached per row")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--backend", choices=["torch", "triton"], default=None,
                        help="bifurcated backend (default: triton with CUDA, else torch)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run_attention_bench(args: argparse.Namespace) -> dict[str, object]:
    """Run the benchmark described by ``args`` and return the result record (medians in seconds)."""
    device, backend = kernel_setup(args.threads, args.device, args.backend)
    from kernels import get_bifurcated_attention
    from kernels.bifurcated import kv_cache_bytes
    from kernels.standard import expand_bifurcated_kv

    attend = get_bifurcated_attention(backend)
    dtype = DTYPES[args.dtype]
    n, ctx, heads, dim, window = args.samples, args.context, args.heads, args.head_dim, args.window
    kv_heads = args.kv_heads or heads
    if heads % kv_heads:
        raise SystemExit("--heads must be a multiple of --kv-heads")
    gen = torch.Generator().manual_seed(args.seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    capacity = args.decode_len + window
    q = rnd(n, heads, window, dim)
    prefix_k, prefix_v = rnd(kv_heads, ctx, dim), rnd(kv_heads, ctx, dim)
    decode_k, decode_v = rnd(n, kv_heads, capacity, dim), rnd(n, kv_heads, capacity, dim)
    base = torch.full((n,), args.decode_len, dtype=torch.int64, device=device)
    lens = base + window
    prefix_offsets, group_offsets = [0, ctx], [0, n]
    k_exp, v_exp, base_exp, lens_exp = expand_bifurcated_kv(
        prefix_k, prefix_v, prefix_offsets, group_offsets, decode_k, decode_v, base, lens
    )
    scale = dim**-0.5
    baseline, standard_attention = expanded_baseline(device)

    def bifurcated() -> torch.Tensor:
        return attend(q, prefix_k, prefix_v, prefix_offsets, group_offsets, decode_k, decode_v, base, lens,
                      scale)

    def standard() -> torch.Tensor:
        return standard_attention(q, k_exp, v_exp, base_exp, lens_exp, scale)

    with torch.inference_mode():
        err = (bifurcated().float() - standard().float()).abs().max().item()
        fns = {"bifurcated": bifurcated, "standard": standard}
        medians = time_interleaved(fns, args.repeats, args.warmup)
    elem = torch.tensor([], dtype=dtype).element_size()
    kv = kv_cache_bytes([ctx], [n], args.decode_len + window, kv_heads, dim, elem)
    allocated = {
        "bifurcated": (prefix_k.numel() + prefix_v.numel() + decode_k.numel() + decode_v.numel()) * elem,
        "standard": (k_exp.numel() + v_exp.numel()) * elem,
    }
    return {
        "benchmark": "attention",
        "samples": n, "context": ctx, "heads": heads, "kv_heads": kv_heads, "head_dim": dim,
        "window": window, "decode_len": args.decode_len, "dtype": args.dtype, "backend": backend, "baseline": baseline,
        "device": str(device), "repeats": args.repeats, "warmup": args.warmup,
        "median_s": medians,
        "ratio_standard_over_bifurcated": medians["standard"] / medians["bifurcated"],
        "max_abs_err": err,
        "kv_bytes": kv,
        "kv_bytes_allocated": allocated,
        "host": host_info(),
    }


def run(args: argparse.Namespace) -> int:
    """``specserve bench attention``: print a table (or ``--json``) of medians, ratio, error, KV bytes."""
    res = run_attention_bench(args)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    med, kv = res["median_s"], res["kv_bytes"]
    print(f"attention: n={res['samples']} context={res['context']} heads={res['heads']}/{res['kv_heads']}kv "
          f"head_dim={res['head_dim']} window={res['window']} dtype={res['dtype']} backend={res['backend']} "
          f"device={res['device']} repeats={res['repeats']}")
    print(f"{'layout':<12}{'median ms':>12}{'KV bytes':>14}{'prompt KV':>14}")
    for name in ("bifurcated", "standard"):
        print(f"{name:<12}{med[name] * 1e3:>12.3f}{format_bytes(kv[name]):>14}"
              f"{format_bytes(kv['prompt_' + name]):>14}")
    print(f"ratio standard/bifurcated: {res['ratio_standard_over_bifurcated']:.2f}x   "
          f"prompt KV reduction: {kv['prompt_standard'] / kv['prompt_bifurcated']:.1f}x   "
          f"max abs err: {res['max_abs_err']:.3g}")
    return 0
