"""The two model roles of speculative decoding, as every layer names them."""

from __future__ import annotations

MODEL_ROLES = ("draft", "target")


def check_role(role: str) -> None:
    """Raise ValueError unless ``role`` is one of MODEL_ROLES."""
    if role not in MODEL_ROLES:
        raise ValueError(f"role must be one of {MODEL_ROLES}, got {role!r}")
