"""The model runtime a service wraps: a checkpoint, its batches held by id, a KV budget, expiry.

All model work and batch mutation happen under one lock: a service runs one forward at a time and
gives it all the cores (torch intra-op threads). With a prefix cache (``engine.prefix_cache``) a group
whose prompt begins with cached blocks prefills only the rest; the cache lives beside the batches and
shares the KV budget with them (unreferenced spans are evicted before a request is refused).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from engine.batch import Batch, GroupInput, SequenceState
from engine.checkpoint import Checkpoint
from engine.decoder import Decoder
from engine.errors import InvalidInput, KVBudgetExceeded, UnknownBatch
from engine.graphs import StepGraphs, graphs_supported
from engine.kv_cache import ATTENTION_LAYOUTS, BifurcatedKV, ExpandedKV, KVLayout
from engine.prefix_cache import PREFIX_BLOCK_TOKENS, PrefixCache, PrefixHit, PrefixSpan
from engine.sampling import sequence_generator
from kernels import backend_for_device, get_bifurcated_attention, get_cascade_attention

# Decode slots reserved per sequence beyond max_new_tokens: the draft window that may overshoot.
SPECULATION_MARGIN = 16


@dataclass
class Prefilled:
    """What a prefill did: each new sequence's first token (the target's; {} from the draft), its
    log-probability for groups that asked (``GroupInput.logprobs``), and, per group, how many prompt tokens
    came from the prefix cache instead of being computed."""

    first_tokens: dict[int, int]
    cached_tokens: dict[int, int]
    first_logprobs: dict[int, float] = field(default_factory=dict)


class ModelRuntime:
    """Batches of one model, keyed by batch id, with their KV caches (see engine.kv_cache)."""

    role = "model"

    def __init__(self, checkpoint: Checkpoint, attention: str = "bifurcated", attention_backend: str | None = None,
                 kv_budget_bytes: int | None = None, session_ttl_s: float = 300.0,
                 cuda_graphs: bool | None = None, prefix_cache_bytes: int = 0,
                 prefix_block_tokens: int = PREFIX_BLOCK_TOKENS) -> None:
        """Serve ``checkpoint`` on the device its weights are on. ``attention_backend`` None picks Triton on
        CUDA and torch on CPU; ``cuda_graphs`` None records steps in CUDA graphs exactly when the model is on
        CUDA and the attention is capturable (Triton bifurcated or the standard layout). A positive
        ``prefix_cache_bytes`` keeps prompt KV of ``prefix_block_tokens``-token blocks across requests, at most
        that many bytes (and within ``kv_budget_bytes``). Raises ValueError for an unknown layout or backend,
        Triton on CPU, or graphs asked for where they cannot run."""
        if attention not in ATTENTION_LAYOUTS:
            raise ValueError(f"attention must be one of {ATTENTION_LAYOUTS}, got {attention!r}")
        self.checkpoint = checkpoint
        self.decoder = Decoder(checkpoint.model, checkpoint.token_map)
        self.attention = attention
        self.attention_backend = backend_for_device(attention_backend, self.decoder.device)
        self._bifurcated = get_bifurcated_attention(self.attention_backend)
        self._cascade = get_cascade_attention(self.attention_backend)
        self.prefix_cache = PrefixCache(prefix_cache_bytes, prefix_block_tokens) if prefix_cache_bytes > 0 else None
        capturable = graphs_supported(self.decoder.device, attention, self.attention_backend)
        if cuda_graphs and not capturable:
            raise ValueError("CUDA graphs need --device cuda and a capturable attention (the triton backend or "
                             f"--attention standard); got {self.decoder.device}, {attention}/{self.attention_backend}")
        self._graphs = StepGraphs(self.decoder) if capturable and cuda_graphs is not False else None
        self.kv_budget_bytes = kv_budget_bytes
        self.session_ttl_s = session_ttl_s
        self.lock = threading.RLock()
        self.batches: dict[str, Batch] = {}
        self._reserved: dict[str, dict[int, int]] = {}  # batch id -> group id -> reserved bytes
        self._spans: dict[str, dict[int, PrefixSpan]] = {}  # batch id -> group id -> its pinned cached span

    # -- sizes -------------------------------------------------------------------------------------
    @property
    def token_kv_bytes(self) -> int:
        """KV bytes one token occupies across all layers (keys and values)."""
        d = self.decoder
        return 2 * d.num_layers * d.kv_heads * d.head_dim * torch.finfo(d.dtype).bits // 8

    def group_kv_bytes(self, prompt_len: int, samples: int, max_new_tokens: int, cached: int = 0) -> int:
        """Upper bound of the KV bytes a group needs in this runtime's layout, beyond the ``cached`` prompt
        tokens that stay in the prefix cache (the expanded layout copies them into every row)."""
        decode = samples * (max_new_tokens + SPECULATION_MARGIN)
        prompt = prompt_len - cached if self.attention == "bifurcated" else samples * prompt_len
        return (prompt + decode) * self.token_kv_bytes

    def kv_bytes_in_use(self) -> int:
        """Bytes held by the KV tensors of all batches."""
        with self.lock:
            return sum(b.kv.nbytes() for b in self.batches.values())

    def stats(self) -> dict[str, int]:
        """Batches, live sequences, KV bytes held and reserved, and the budget (0 = unbounded)."""
        with self.lock:
            cache = self.prefix_cache.stats() if self.prefix_cache is not None else {}
            return {
                "batches": len(self.batches),
                "sequences": sum(len(b.sequences) for b in self.batches.values()),
                "kv_bytes": sum(b.kv.nbytes() for b in self.batches.values()),
                "kv_reserved_bytes": self._reserved_bytes(),
                "kv_budget_bytes": self.kv_budget_bytes or 0,
                "prefix_cache_bytes": cache.get("prefix_cache_bytes", 0),
                "prefix_cache_spans": cache.get("prefix_cache_spans", 0),
                "prefix_cache_lookup_tokens": cache.get("prefix_cache_lookup_tokens", 0),
                "prefix_cache_hit_tokens": cache.get("prefix_cache_hit_tokens", 0),
                "prefix_cache_refs": self.prefix_cache.pinned_refs() if self.prefix_cache is not None else 0,
            }

    def _reserved_bytes(self) -> int:
        return sum(sum(r.values()) for r in self._reserved.values())

    @property
    def cuda_graphs(self) -> bool:
        """True when window steps are recorded and replayed as CUDA graphs."""
        return self._graphs is not None

    def forward(self, tokens: torch.Tensor, widths: torch.Tensor, base: torch.Tensor, kv: KVLayout,
                last_only: bool) -> torch.Tensor:
        """One batched window step (``Decoder.step``), through CUDA graphs when they are on."""
        if self._graphs is not None:
            return self._graphs.step(tokens, widths, base, kv, last_only)
        return self.decoder.step(tokens, widths, base, kv, last_only)

    # -- batches -----------------------------------------------------------------------------------
    def _new_layout(self) -> KVLayout:
        d = self.decoder
        if self.attention == "bifurcated":
            return BifurcatedKV(d.num_layers, d.kv_heads, d.head_dim, d.dtype, self._bifurcated, d.device,
                                self._cascade)
        return ExpandedKV(d.num_layers, d.kv_heads, d.head_dim, d.dtype, d.device)

    def get_batch(self, batch_id: str) -> Batch:
        """The live batch with this id (caller holds the lock); raises UnknownBatch."""
        batch = self.batches.get(batch_id)
        if batch is None:
            raise UnknownBatch(f"batch {batch_id!r} is not held by this {self.role} service "
                               "(released, expired or never prefilled)")
        batch.touch()
        return batch

    def _validate_group(self, group: GroupInput, live: set[int], live_groups: set[int]) -> None:
        vocab = self.checkpoint.vocab_size
        if not group.prompt_token_ids:
            raise InvalidInput(f"group {group.group_id}: prompt_token_ids is empty")
        bad = [t for t in group.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidInput(
                f"group {group.group_id}: prompt_token_ids {bad[:5]} outside the vocabulary [0, {vocab})")
        if not group.sequence_ids or len(set(group.sequence_ids)) != len(group.sequence_ids):
            raise InvalidInput(f"group {group.group_id}: sequence_ids must be non-empty and distinct")
        if live & set(group.sequence_ids):
            taken = sorted(live & set(group.sequence_ids))[:5]
            raise InvalidInput(f"group {group.group_id}: sequence ids {taken} are already live")
        if group.group_id in live_groups:
            raise InvalidInput(f"group {group.group_id} is already live in this batch; group ids must be distinct")
        if group.max_new_tokens <= 0:
            raise InvalidInput(f"group {group.group_id}: max_new_tokens must be positive")
        total = len(group.prompt_token_ids) + group.max_new_tokens
        if total > self.checkpoint.max_context:
            raise InvalidInput(f"group {group.group_id}: prompt ({len(group.prompt_token_ids)}) + max_new_tokens "
                               f"({group.max_new_tokens}) exceeds the model context {self.checkpoint.max_context}")
        try:
            group.params.validate()
        except ValueError as error:
            raise InvalidInput(f"group {group.group_id}: {error}") from error

    def _cache_bytes(self) -> int:
        return self.prefix_cache.bytes if self.prefix_cache is not None else 0

    def _free_bytes(self) -> int | None:
        """Budget bytes neither reserved by groups nor held by the prefix cache (None: unbounded)."""
        if self.kv_budget_bytes is None:
            return None
        return self.kv_budget_bytes - self._reserved_bytes() - self._cache_bytes()

    def _reserve(self, batch_id: str, groups: Sequence[GroupInput], cached: dict[int, int]) -> None:
        needed = {g.group_id: self.group_kv_bytes(len(g.prompt_token_ids), len(g.sequence_ids), g.max_new_tokens,
                                                  cached.get(g.group_id, 0))
                  for g in groups}
        free = self._free_bytes()
        if free is not None and sum(needed.values()) > free and self.prefix_cache is not None:
            self.prefix_cache.evict(sum(needed.values()) - free)  # unreferenced spans go before a refusal
            free = self._free_bytes()
        if free is not None and sum(needed.values()) > free:
            assert self.kv_budget_bytes is not None
            raise KVBudgetExceeded(
                f"KV cache budget of the {self.role} service exhausted: {self.kv_budget_bytes - free} of "
                f"{self.kv_budget_bytes} bytes reserved or pinned by the prefix cache, the new groups need "
                f"{sum(needed.values())}; retry later or with fewer samples/tokens"
            )
        self._reserved.setdefault(batch_id, {}).update(needed)

    def _match(self, group: GroupInput, count: bool) -> PrefixHit:
        """The group's cached prompt head, pinned. It may be the whole prompt: the prefill then recomputes the
        last position only (for its logits), so a repeated prompt reuses its cached path without a split."""
        assert self.prefix_cache is not None
        generation = self.prefix_cache.generation
        hit = self.prefix_cache.match(group.prompt_token_ids, len(group.prompt_token_ids), count=count)
        self.prefix_cache.acquire(hit.span)
        if self.prefix_cache.generation != generation:  # a span was split: layouts reading it re-plan
            for batch in self.batches.values():
                batch.kv.shared_changed()
        return hit

    def prefill(self, batch_id: str, groups: Sequence[GroupInput]) -> Prefilled:
        """Prefill each group's prompt once into the batch (created when new) and add its sequences.

        Returns each new sequence's first token (the target samples it; the draft returns {}) and the
        prompt tokens each group read from the prefix cache. Validates and reserves everything before
        changing any batch: a bad group leaves the batch untouched.
        """
        with self.lock:
            batch = self.batches.get(batch_id)
            live = batch.ids() if batch else set()
            live_groups = set(self._reserved.get(batch_id, {}))
            for group in groups:
                self._validate_group(group, live, live_groups)
                live.update(group.sequence_ids)
                live_groups.add(group.group_id)
            planned: dict[int, PrefixHit] = {}
            try:
                if self.prefix_cache is not None:
                    planned = {g.group_id: self._match(g, count=False) for g in groups}
                self._reserve(batch_id, groups, {gid: hit.tokens for gid, hit in planned.items()})
                if batch is None:
                    batch = self.batches[batch_id] = Batch(batch_id, self._new_layout())
                batch.touch()
                result = Prefilled({}, {})
                for group in groups:
                    self._prefill_group(batch, group, planned.pop(group.group_id, None), result)
                return result
            finally:
                for hit in planned.values():
                    PrefixCache.release(hit.span)

    def _prefill_group(self, batch: Batch, group: GroupInput, planned: PrefixHit | None, result: Prefilled) -> None:
        """Prefill one group after its reservation: the cached head is read from the prefix cache, the rest
        is computed and its full blocks inserted into the cache (as far as the budget allows)."""
        prompt = group.prompt_token_ids
        cache = self.prefix_cache
        hit = PrefixHit(None, 0)
        if cache is not None and planned is not None:
            hit = self._match(group, count=True)  # may reach further than planned: earlier groups inserted
            PrefixCache.release(planned.span)
        # A wholly cached prompt still runs its last token (after the cached KV of the others) for the logits.
        start = min(hit.tokens, len(prompt) - 1)
        logits, keys, values = self.decoder.prefill(prompt[start:], _path_kv(hit.span, start))
        deepest = hit
        if cache is not None:
            if hit.tokens < len(prompt):
                free = self._free_bytes()
                aligned = len(prompt) // cache.block_tokens * cache.block_tokens - hit.tokens
                credit = max(aligned, 0) * self.token_kv_bytes if self.attention == "bifurcated" else 0
                room = 1 << 62 if free is None else free + credit  # inserted blocks leave the group's reservation
                deepest = cache.insert(hit, prompt, keys, values, room)
            cache.acquire(deepest.span)
            PrefixCache.release(hit.span)
            if deepest.span is not None:
                self._spans.setdefault(batch.batch_id, {})[group.group_id] = deepest.span
            self._reserved[batch.batch_id][group.group_id] = self.group_kv_bytes(
                len(prompt), len(group.sequence_ids), group.max_new_tokens, deepest.tokens)
        own = deepest.tokens - start
        states = [
            SequenceState(sid, group.group_id, group.params, sequence_generator(group.params.seed, index, self.role),
                          logprobs=group.logprobs)
            for index, sid in enumerate(group.sequence_ids)
        ]
        batch.add(states, [k[:, own:] for k in keys], [v[:, own:] for v in values], deepest.span)
        self._start_sequences(group, states, logits, result)
        result.cached_tokens[group.group_id] = start

    def _start_sequences(self, group: GroupInput, states: Sequence[SequenceState], logits: torch.Tensor,
                         result: Prefilled) -> None:
        """Hook run on a group's new sequences after its prefill (``logits``: the prompt's last position); the
        role that picks first tokens (the target) records them, and their logprobs, in ``result``."""

    def release(self, batch_id: str, sequence_ids: Iterable[int] = ()) -> int:
        """Release sequences of a batch, or the whole batch when none are given. Returns the count."""
        with self.lock:
            batch = self.batches.get(batch_id)
            if batch is None:
                return 0
            ids = list(sequence_ids)
            released = batch.release(ids) if ids else len(batch.sequences)
            if not ids or not batch.sequences:
                del self.batches[batch_id]
            self._forget_groups(batch_id)
            return released

    def _forget_groups(self, batch_id: str) -> None:
        batch = self.batches.get(batch_id)
        live_groups = {s.group_id for s in batch.sequences} if batch else set()
        reserved = self._reserved.get(batch_id, {})
        for group_id in list(reserved):
            if group_id not in live_groups:
                del reserved[group_id]
        if not reserved:
            self._reserved.pop(batch_id, None)
        spans = self._spans.get(batch_id, {})
        for group_id in list(spans):
            if group_id not in live_groups:
                PrefixCache.release(spans.pop(group_id))
        if not spans:
            self._spans.pop(batch_id, None)

    def release_in_batch(self, batch: Batch, sequence_ids: Iterable[int]) -> None:
        """Drop finished sequences named in a Propose/Verify before the step runs."""
        if batch.release(sequence_ids):
            self._forget_groups(batch.batch_id)

    def expire_idle(self, now: float | None = None) -> list[str]:
        """Release batches idle for longer than the session TTL; returns their ids."""
        now = time.monotonic() if now is None else now
        with self.lock:
            expired = [bid for bid, b in self.batches.items() if now - b.last_used > self.session_ttl_s]
            for batch_id in expired:
                self.release(batch_id)
            return expired


def _path_kv(span: PrefixSpan | None, tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """Per-layer keys and values [Hkv, tokens, D] of the first ``tokens`` positions of ``span``'s cached path
    (None when there are none), as a prefill's past."""
    if span is None or tokens == 0:
        return None
    path = span.path()
    layers = len(path[0].keys)
    return ([torch.cat([s.keys[i] for s in path], dim=1)[:, :tokens] for i in range(layers)],
            [torch.cat([s.values[i] for s in path], dim=1)[:, :tokens] for i in range(layers)])
