"""A forward pass over HF Llama-family decoder modules with specserve's own KV layouts.

The weights and the modules (norms, projections, MLP, rotary embedding) are the checkpoint's own; only
the attention and the cache are specserve's, so ragged windows of many sequences run in one batch.

A ragged batch (rows of different window widths, e.g. per-sequence draft lengths) is *packed* for the
token-wise work: norms, projections, MLP and LM head run on the real tokens only, and only the attention
and the cache see the padded [B, W] layout. On a CPU verify is compute-bound, so the padding would cost as
much as real tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from engine.kv_cache import KVLayout
from engine.token_map import TokenMap


class Decoder:
    """Runs prompt prefill (batch 1) and batched window steps over a KV layout.

    With a ``token_map`` (a subset-vocabulary draft) token ids in and logits out are the target's: the map is
    applied at the embedding and after the LM head."""

    def __init__(self, model: PreTrainedModel, token_map: TokenMap | None = None) -> None:
        self.model = model
        self.token_map = token_map
        self.body = model.model
        config = model.config
        self.num_layers = int(config.num_hidden_layers)
        self.q_heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.q_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.q_heads)
        self.scale = float(self.body.layers[0].self_attn.scaling)
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device

    def _qkv(self, layer: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             shape: tuple[int, int], packed: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [B, H, W, D] of the window ``shape`` (B, W) from normed hidden states ``x`` ([B, W, H], or
        [N, H] of the ``packed`` positions of the flattened window, whose padding comes back as zeros)."""
        attn = layer.self_attn
        q, k, v = (_unpack(proj(x).view(*x.shape[:-1], -1, self.head_dim), packed, shape)
                   for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def _finish_layer(self, layer: torch.nn.Module, h: torch.Tensor, o: torch.Tensor,
                      packed: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream ``h`` (laid out as in ``_qkv``) after the attention output o [B, Hq, W, D]."""
        batch, _, width, _ = o.shape
        o = o.transpose(1, 2).reshape(batch, width, -1)
        h = h + layer.self_attn.o_proj(o if packed is None else o.reshape(batch * width, -1)[packed])
        return h + layer.mlp(layer.post_attention_layernorm(h))

    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int], past: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
                ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Run a prompt (batch 1, causal) and return (logits of its last position [V], per-layer keys and
        values [Hkv, P, D]) — the prompt KV that a group stores once.

        With ``past`` (per-layer keys, values [Hkv, M, D] of the prompt's first M tokens, e.g. from a prefix
        cache), ``token_ids`` are the tokens after them: they sit at positions M.. and attend to the past too;
        the returned KV covers ``token_ids`` only."""
        done = int(past[0][0].shape[1]) if past is not None else 0
        tokens = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        width = tokens.shape[1]
        positions = torch.arange(done, done + width, device=self.device)[None, :]
        h = self._embed(tokens)
        cos, sin = self.body.rotary_emb(h, positions)
        mask = None
        if done:  # query i sees the whole past and its own window up to i
            mask = torch.arange(done + width, device=self.device)[None, :] <= positions[0, :, None]
        keys, values = [], []
        for index, layer in enumerate(self.body.layers):
            q, k, v = self._qkv(layer, layer.input_layernorm(h), cos, sin, (1, width))
            keys.append(k[0])
            values.append(v[0])
            if past is not None and done:
                k = torch.cat([past[0][index].to(k)[None], k], dim=2)
                v = torch.cat([past[1][index].to(v)[None], v], dim=2)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                enable_gqa=self.q_heads != self.kv_heads,
            )
            h = self._finish_layer(layer, h, o)
        return self._logits(h[:, -1])[0], keys, values

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, widths: torch.Tensor, base: torch.Tensor,
             kv: KVLayout, last_only: bool) -> torch.Tensor:
        """One batched forward over ragged windows and append their KV.

        tokens [B, W]: row b's window is tokens[b, :widths[b]] (the rest is padding), placed after the
        row's prompt and its ``base[b]`` decode tokens already cached. Inputs may be on any device (host
        tensors avoid a synchronisation). Returns float32 logits on the model's device, [B, W, V], or
        [B, V] at each row's last window position when ``last_only``.
        """
        kv.reserve(base.tolist(), tokens.shape[1])
        width = tokens.shape[1]
        ragged = bool((widths < width).any())
        packed = (torch.arange(width)[None, :] < widths.cpu()[:, None]).flatten().nonzero()[:, 0] if ragged else None
        return self.forward_window(tokens.to(self.device), widths.to(self.device), base.to(self.device), kv,
                                   last_only, None if packed is None else packed.to(self.device))

    @torch.inference_mode()
    def forward_window(self, tokens: torch.Tensor, widths: torch.Tensor, base: torch.Tensor,
                       kv: KVLayout, last_only: bool, packed: torch.Tensor | None = None) -> torch.Tensor:
        """``step`` after ``kv.reserve``: inputs already on the model's device; only device work is launched
        (no host synchronisation), so with a capturable attention it can be recorded in a CUDA graph.

        ``packed``: the positions of the flattened [B * W] window that hold real tokens (row-major); the
        token-wise layers then skip the padding, whose logits come back as zeros. The logits of a row with an
        empty window (width 0) are arbitrary."""
        batch, width = tokens.shape
        positions = kv.row_prefix_lens()[:, None] + base[:, None] + torch.arange(width, device=self.device)[None, :]
        lens = base + widths
        h = self._embed(tokens if packed is None else tokens.flatten()[packed])
        cos, sin = self.body.rotary_emb(h, positions)
        for index, layer in enumerate(self.body.layers):
            q, k, v = self._qkv(layer, layer.input_layernorm(h), cos, sin, (batch, width), packed)
            kv.write(index, k, v, base)
            o = kv.attend(index, q, base, lens, self.scale)
            h = self._finish_layer(layer, h, o, packed)
        if packed is not None and not last_only:
            return _unpack(self._logits(h), packed, (batch, width))
        if packed is not None:  # the last real token of row b is packed entry cumsum(widths)[b] - 1
            return self._logits(h[(widths.cumsum(0) - 1).clamp(min=0)])
        if last_only:
            h = h[torch.arange(batch, device=self.device), (widths - 1).clamp(min=0)]
        return self._logits(h)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.body.embed_tokens(tokens if self.token_map is None else self.token_map.to_draft(tokens))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.model.lm_head(self.body.norm(h)).float()
        return logits if self.token_map is None else self.token_map.to_target_logits(logits)


def _unpack(x: torch.Tensor, packed: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor:
    """x [N, ...] of the ``packed`` positions laid out as [B, W, ...] (``shape`` = (B, W)), zeros elsewhere;
    x itself (already [B, W, ...]) when nothing is packed."""
    if packed is None:
        return x
    out = x.new_zeros(shape[0] * shape[1], *x.shape[1:])
    return out.index_copy_(0, packed, x).view(*shape, *x.shape[1:])
