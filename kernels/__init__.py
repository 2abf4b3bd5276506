"""Attention kernels: bifurcated (shared-prefix) attention and the standard expanded-KV baseline."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

import torch

# backend name -> {kind: "module:function"} for the two-level (bifurcated) and the many-level (cascade)
# attention. The Triton module is imported lazily (importing triton on a CPU-only machine is harmless, but
# its kernels need TRITON_INTERPRET=1 set before the import to run on CPU).
ATTENTION_BACKENDS: dict[str, dict[str, str]] = {
    "torch": {"bifurcated": "kernels.bifurcated:bifurcated_attention",
              "cascade": "kernels.cascade:cascade_attention"},
    "triton": {"bifurcated": "kernels.bifurcated_triton:bifurcated_attention_triton",
               "cascade": "kernels.bifurcated_triton:cascade_attention_triton"},
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
    return _backend_function(backend, "bifurcated")


def get_cascade_attention(backend: str | None = None) -> Callable[..., torch.Tensor]:
    """Return the cascade-attention function of ``backend`` (names as for ``get_bifurcated_attention``): the
    signature of :func:`kernels.cascade.cascade_attention` (levels of shared context plus per-row decode KV),
    the same result up to rounding. Raises ``ValueError`` for an unknown backend name."""
    return _backend_function(backend, "cascade")


def _backend_function(backend: str | None, kind: str) -> Callable[..., torch.Tensor]:
    name = default_backend() if backend in (None, "", "auto") else backend
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {sorted(ATTENTION_BACKENDS)}")
    module, function = ATTENTION_BACKENDS[name][kind].split(":")
    return getattr(importlib.import_module(module), function)


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
