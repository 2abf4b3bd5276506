"""Shared timing helpers for the benchmarks: medians of interleaved repeats, host/device info."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import torch


def kernel_setup(threads: int | None, device: str | None, backend: str | None) -> tuple[torch.device, str]:
    """Apply the torch thread count and resolve (device, bifurcated backend): CUDA and Triton when available,
    else CPU and torch; Triton on CPU turns on its interpreter (effective only before triton is imported)."""
    if threads:
        torch.set_num_threads(threads)
    resolved = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    name = backend or ("triton" if resolved.type == "cuda" else "torch")
    if name == "triton" and resolved.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return resolved, name


def expanded_baseline(device: torch.device) -> tuple[str, Callable[..., torch.Tensor]]:
    """(name, fn) of the expanded-KV baseline the benchmarks time, ``fn(q, k, v, base, lens, scale)``: on CUDA
    SDPA over the full cache without a mask (flash kernels; every benchmark row ends at the last cache slot),
    elsewhere the masked SDPA the serving runtime uses (so CPU figures stay comparable with earlier runs)."""
    from kernels.standard import full_cache_attention, standard_attention

    if device.type == "cuda":
        return "sdpa-full-cache", lambda q, k, v, base, lens, scale: full_cache_attention(q, k, v, scale)
    return "sdpa-masked", standard_attention


def synchronize() -> None:
    """Wait for queued CUDA work (a no-op without CUDA), so that wall-clock timings are complete."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_interleaved_samples(
    fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Wall-clock seconds of every call of each function, the functions interleaved.

    Each function is first called ``warmup`` times (untimed). Then ``repeats`` rounds each call every
    function once, the order rotating from round to round, so that slow drifts of the machine (other
    load, frequency, caches) affect all candidates alike. Returns ``{name: [seconds per repeat]}``.
    """
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    names = list(fns)
    for _ in range(max(warmup, 0)):
        for name in names:
            fns[name]()
    synchronize()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats):
        shift = rep % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            fns[name]()
            synchronize()
            samples[name].append(time.perf_counter() - start)
    return samples


def time_interleaved(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median wall-clock seconds per call of each function, measured with interleaved repeats.

    See :func:`time_interleaved_samples`; returns ``{name: median seconds}``.
    """
    return {name: statistics.median(s) for name, s in time_interleaved_samples(fns, repeats, warmup).items()}


def cpu_model() -> str:
    """The CPU model name (from /proc/cpuinfo where available, else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def host_info() -> dict[str, object]:
    """Hardware/software description stored with benchmark results (CPU model, cores, threads, torch, GPU)."""
    info: dict[str, object] = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if hasattr(os, "getloadavg"):
        info["loadavg_1m"] = round(os.getloadavg()[0], 2)  # other load on the machine while measuring
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def format_bytes(n: float) -> str:
    """Human-readable byte count with binary prefixes (e.g. ``"256.0 MiB"``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.1f} TiB"
