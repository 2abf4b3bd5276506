"""The torch device a model service runs on, resolved once at start-up."""

from __future__ import annotations

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")


class DeviceUnavailable(ValueError):
    """A requested device this machine does not have; the message says what to do instead."""


def resolve_device(name: str | None = "auto") -> torch.device:
    """The device for ``name``: "auto" (or None) is CUDA when available, else CPU; "cpu"; "cuda" or "cuda:N".

    Raises DeviceUnavailable when CUDA is asked for and torch sees no CUDA device (CPU-only build, no
    driver or index out of range), and for a name that is not a cpu/cuda device.
    """
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise DeviceUnavailable(f"unknown device {name!r}; choose one of {DEVICE_CHOICES} (or cuda:N)") from error
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise DeviceUnavailable(f"device {name!r} is not supported; choose one of {DEVICE_CHOICES} (or cuda:N)")
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise DeviceUnavailable(f"--device {name}: no CUDA device is visible to torch {torch.__version__} "
                                f"({build}); use --device cpu or install a CUDA build (docs/gpu.md)")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise DeviceUnavailable(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return device
