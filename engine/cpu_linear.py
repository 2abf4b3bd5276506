"""Linear layers of a float32 model on the CPU through oneDNN with weights packed once at load.

PyTorch's ``nn.Linear`` on a float32 CPU tensor calls the BLAS ``sgemm`` (MKL in the official wheels), which
copies blocks of both operands into its own layout on every call (as GotoBLAS-style GEMMs do). A decode step
multiplies a few rows by every weight of the model, so it is bound by reading the weights: on the 2-core AMD
EPYC of docs/benchmarks.md a 1536 × 576 projection of 8 rows streamed its weights at 6–9 GB/s against the
28 GB/s the memory gives, and the 49,152-row LM head took 20.7 ms. oneDNN's matmul on a weight packed once into
its layout (``Tensor.to_mkldnn``; ``torch.ops.mkldnn._linear_pointwise``, the op PyTorch's own compiler emits
for fused CPU linear layers) streamed them at 11–13 GB/s: the same products took 1.3–2x less time, the head
9.7 ms (one-off runs, docs/benchmarks.md). The op is private to PyTorch (pinned here); where it is missing
nothing is packed.

``pack_linears`` replaces each float32 ``nn.Linear`` of a CPU model by a ``PackedLinear`` holding the packed
copy. The products are the same sums in another order, so logits move by float32 rounding (about 1e-5 of
their size, as between two batch sizes of ``sgemm``): greedy output still follows the model, and BASS stays
identical to the target alone because its verify and the target's plain steps both run these layers. A tied
LM head gets a packed copy of its own while the embedding keeps the dense weight (for the default target,
113 MB more). bfloat16 models already run on oneDNN through ``nn.Linear`` and are left as they are.
``SPECSERVE_ONEDNN_LINEAR=0`` turns packing off; without oneDNN nothing changes.
"""

from __future__ import annotations

import os

import torch

ENV_SWITCH = "SPECSERVE_ONEDNN_LINEAR"


class PackedLinear(torch.nn.Module):
    """``y = x W^T + b`` of a float32 ``nn.Linear`` with W in oneDNN's layout; x of any leading shape. Its state
    dict holds ``weight`` (a dense copy) and ``bias`` as ``nn.Linear``'s does."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        """A packed copy of ``linear`` (float32, on the CPU); the bias is shared, not copied."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = linear.weight.detach().to_mkldnn()
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output, a dense float32 tensor of x's leading shape and ``out_features``."""
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.packed_weight.to_dense()  # the state dict stays nn.Linear's

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def onednn_linear_available() -> bool:
    """True when this PyTorch has oneDNN and its packed-weight linear, and ``SPECSERVE_ONEDNN_LINEAR`` is not 0."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    return hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every float32 CPU ``nn.Linear`` of ``model`` by a ``PackedLinear`` (for inference: the packed
    weights take no gradient) and return how many were replaced; 0, with the model untouched, where
    ``onednn_linear_available`` says no."""
    if not onednn_linear_available():
        return 0
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if (isinstance(child, torch.nn.Linear) and child.weight.dtype == torch.float32
                    and child.weight.device.type == "cpu"):
                setattr(module, name, PackedLinear(child))
                replaced += 1
    return replaced
