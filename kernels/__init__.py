"""Attention kernels: bifurcated (shared-prefix) attention and the standard expanded-KV baseline."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

import torch

# backend name -> (module, function); the Triton module is imported lazily (importing triton on a CPU-only
# machine is harmless, but its kernels need TRITON_INTERPRET=1 set before the import to run on CPU).
ATTENTION_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("kernels.bifurcated", "bifurcated_attention"),
    "triton": ("kernels.bifurcated_triton", "bifurcated_attention_triton"),
}
# backend name -> its (context part, decode part) functions, which cascade attention composes.
ATTENTION_PARTS: dict[str, tuple[str, str]] = {
    "torch": ("context_attention", "decode_attention"),
    "triton": ("context_attention_triton", "decode_attention_triton"),
}


def triton_interpreted() -> bool:
    """True when Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in {"1", "true", "yes", "on"}


def default_backend() -> str:
    """The default bifurcated-attention backend: "triton" when CUDA is available, else "torch"."""
    return backend_for_device(None, torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def get_bifurcated_attention(backend: str | None = None) -> Callable[..., torch.Tensor]:
    """Return the bifurcated-attention function of ``backend`` ("torch" or "triton"; None/"auto": default).

    Every backend has the signature of :func:`kernels.bifurcated.bifurcated_attention` and the same
    result up to floating-point rounding. Raises ``ValueError`` for an unknown backend name.
    """
    module, name = _backend_module(backend)
    return getattr(module, ATTENTION_BACKENDS[name][1])


def get_attention_parts(backend: str | None = None) -> tuple[Callable[..., tuple[torch.Tensor, torch.Tensor]],
                                                             Callable[..., tuple[torch.Tensor, torch.Tensor]]]:
    """The (context, decode) part functions of ``backend``, with the signatures of
    :func:`kernels.bifurcated.context_attention` and :func:`kernels.bifurcated.decode_attention`; both return
    fp32 (o, lse). Raises ``ValueError`` for an unknown backend name."""
    module, name = _backend_module(backend)
    context, decode = ATTENTION_PARTS[name]
    return getattr(module, context), getattr(module, decode)


def _backend_module(backend: str | None) -> tuple[object, str]:
    name = default_backend() if backend in (None, "", "auto") else backend
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {sorted(ATTENTION_BACKENDS)}")
    return importlib.import_module(ATTENTION_BACKENDS[name][0]), name


def backend_for_device(backend: str | None, device: torch.device) -> str:
    """The bifurcated backend to run on ``device``: ``backend`` itself, or for None/"auto" "triton" on CUDA
    and "torch" elsewhere.

    Raises ``ValueError`` for an unknown name, and for "triton" on a CPU device unless ``TRITON_INTERPRET=1``
    (Triton's CPU interpreter, for tests) is set.
    """
    name = ("triton" if device.type == "cuda" else "torch") if backend in (None, "", "auto") else backend
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {sorted(ATTENTION_BACKENDS)}")
    if name == "triton" and device.type == "cpu" and not triton_interpreted():
        raise ValueError("the triton attention backend runs on CUDA devices (on CPU only under TRITON_INTERPRET=1); "
                         "use --attention-backend torch with --device cpu")
    return name
