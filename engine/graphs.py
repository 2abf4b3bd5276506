"""CUDA graphs of the batched window step: small models on a GPU are launch-bound (a step is hundreds of
small kernels), so each step shape is recorded once and replayed.

Shapes are bucketed: a window of W tokens is right-padded to the smallest width bucket >= W (the padding
positions are masked out and their logits dropped), and the KV slabs grow by doubling, so a batch meets
few shapes. The rows of a batch are not padded: a graph belongs to one layout version (its groups and
slab tensors); when sequences leave or the slabs grow, the layout's graphs are dropped and the next
shapes are recorded again. A shape is captured the second time it is seen (``capture_after``), so a
one-off shape costs no capture. The sampling between steps (per-sequence CPU generators) stays eager.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.decoder import Decoder
from engine.kv_cache import KVLayout

WIDTH_BUCKETS = (1, 2, 4, 8, 16, 32)


def graphs_supported(device: torch.device, attention: str, backend: str) -> bool:
    """True when window steps on ``device`` with this KV layout and bifurcated backend can be captured: CUDA,
    and an attention that never synchronises with the host (Triton bifurcated, or the standard layout)."""
    return device.type == "cuda" and (attention == "standard" or backend == "triton")


def bucket_width(width: int, buckets: Sequence[int] = WIDTH_BUCKETS) -> int:
    """The smallest bucket >= ``width`` (``width`` itself when it exceeds every bucket); raises ValueError
    for a width < 1."""
    if width < 1:
        raise ValueError(f"window width must be >= 1, got {width}")
    return next((b for b in sorted(buckets) if b >= width), width)


def pad_width(tokens: torch.Tensor, width: int) -> torch.Tensor:
    """tokens [B, W] right-padded with token 0 to [B, width] (``width`` >= W)."""
    extra = width - tokens.shape[1]
    if extra < 0:
        raise ValueError(f"cannot pad a window of {tokens.shape[1]} tokens to {width}")
    return torch.nn.functional.pad(tokens, (0, extra)) if extra else tokens


WindowRun = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def bucketed_step(decoder: Decoder, tokens: torch.Tensor, widths: torch.Tensor, base: torch.Tensor,
                  kv: KVLayout, last_only: bool, run: WindowRun | None = None) -> torch.Tensor:
    """``decoder.step`` with the window padded to its width bucket; same logits as the unpadded step.

    ``run(tokens, widths, base, last_only)`` computes the padded step on device tensors after the KV
    reserve (default: ``decoder.forward_window`` over ``kv``); the logits of padding positions are dropped.
    """
    width = tokens.shape[1]
    bucket = bucket_width(width)
    kv.reserve(base.tolist(), bucket)
    device = decoder.device
    args = (pad_width(tokens, bucket).to(device), widths.to(device), base.to(device))
    logits = decoder.forward_window(*args, kv, last_only) if run is None else run(*args, last_only)
    return logits if last_only else logits[:, :width]


@dataclass
class _Recorded:
    """One captured step: its graph, the static buffers it reads and writes, and tensors it must outlive."""

    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    output: torch.Tensor
    keep: list[object]


@dataclass
class _LayoutGraphs:
    """The graphs of one KV layout at one version, and how often each shape was seen."""

    version: int
    graphs: dict[tuple, _Recorded] = field(default_factory=dict)
    uses: Counter = field(default_factory=Counter)


class StepGraphs:
    """``Decoder.step`` through CUDA graphs (CUDA only; the attention must be capturable: the Triton
    bifurcated backend or the standard layout). Returns the same logits as ``Decoder.step``."""

    def __init__(self, decoder: Decoder, capture_after: int = 2) -> None:
        if decoder.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {decoder.device}")
        self.decoder = decoder
        self.capture_after = capture_after
        self._pool = torch.cuda.graph_pool_handle()
        self._layouts: weakref.WeakKeyDictionary[KVLayout, _LayoutGraphs] = weakref.WeakKeyDictionary()
        self.captures = 0

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, widths: torch.Tensor, base: torch.Tensor, kv: KVLayout,
             last_only: bool) -> torch.Tensor:
        """One batched window step (see ``Decoder.step``), replayed from a graph once its shape repeats."""

        def run(tokens: torch.Tensor, widths: torch.Tensor, base: torch.Tensor, last_only: bool) -> torch.Tensor:
            state = self._state(kv)
            key = (tokens.shape[0], tokens.shape[1], last_only)
            recorded = state.graphs.get(key)
            if recorded is None:
                state.uses[key] += 1
                if state.uses[key] < self.capture_after or tokens.shape[1] not in WIDTH_BUCKETS:
                    return self.decoder.forward_window(tokens, widths, base, kv, last_only)
                recorded = state.graphs[key] = self._capture(kv, tokens, widths, base, last_only)
            for buffer, value in zip(recorded.inputs, (tokens, widths, base), strict=True):
                buffer.copy_(value)
            recorded.graph.replay()
            return recorded.output.clone()

        return bucketed_step(self.decoder, tokens, widths, base, kv, last_only, run)

    def _state(self, kv: KVLayout) -> _LayoutGraphs:
        state = self._layouts.get(kv)
        if state is None or state.version != kv.version:
            state = self._layouts[kv] = _LayoutGraphs(kv.version)
        return state

    def _capture(self, kv: KVLayout, tokens: torch.Tensor, widths: torch.Tensor, base: torch.Tensor,
                 last_only: bool) -> _Recorded:
        """Record the step on static copies of its inputs. The warm-up run on a side stream (PyTorch's
        capture recipe) writes the same KV the replay writes again: a step is idempotent for fixed inputs."""
        from kernels.bifurcated_triton import retain_launch_tensors

        inputs = (tokens.clone(), widths.clone(), base.clone())
        kv.row_prefix_lens()  # allocated on the current stream, before the side stream runs
        current = torch.cuda.current_stream(self.decoder.device)
        side = torch.cuda.Stream(self.decoder.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self.decoder.forward_window(*inputs, kv, last_only)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with retain_launch_tensors() as keep, torch.cuda.graph(graph, pool=self._pool):
            output = self.decoder.forward_window(*inputs, kv, last_only)
        self.captures += 1
        return _Recorded(graph, inputs, output, keep)
