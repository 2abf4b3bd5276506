"""A prefix cache across requests: prompt KV of token blocks, keyed by content, shared and evicted LRU.

Prompts are cut into blocks of ``block_tokens`` ids. Block ``i`` of a prompt is keyed by a hash chain,
``h_i = hash((h_{i-1}, tokens of block i))``, so a key names the whole prefix up to and including the block
(two prompts share the key of block ``i`` exactly when their first ``i + 1`` blocks agree; the tokens are
compared too, so a hash collision is never a false hit).

Blocks live in *spans*: nodes of a tree (a radix tree over blocks) whose KV is stored contiguously per
layer, ``[Hkv, tokens, D]``, so attention reads a span in one GEMM. A prompt's cached part is a path
from the root; a span is split where two prompts diverge inside it. Hydragen's tree (system prompt →
per-problem prompt → samples) is such a path, shared by all the requests below it.

A live group holds a reference on the deepest span of its path; spans with references or children are
never evicted, so a group's whole path outlives it. Unreferenced leaf spans are evicted least recently
used first when room is needed (``evict``). The cache does no locking: its runtime serialises calls.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

PREFIX_BLOCK_TOKENS = 16
_ROOT_HASH = 0


@dataclass(eq=False)
class PrefixSpan:
    """A run of cached blocks: its token ids, per-layer keys/values [Hkv, len(tokens), D], tree links."""

    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    hashes: list[int]
    parent: PrefixSpan | None
    children: dict[int, PrefixSpan] = field(default_factory=dict)
    refs: int = 0
    last_used: float = 0.0
    serial: int = 0

    def path(self) -> list[PrefixSpan]:
        """The spans from the root down to this one; their tokens concatenated are the cached prefix."""
        spans: list[PrefixSpan] = []
        node: PrefixSpan | None = self
        while node is not None:
            spans.append(node)
            node = node.parent
        return spans[::-1]

    def end(self) -> int:
        """Prompt position just after this span (the cached prefix length its path covers)."""
        return sum(len(s.tokens) for s in self.path())

    def nbytes(self) -> int:
        """Bytes of this span's keys and values (all layers)."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def chain_hash(parent_hash: int, block: Sequence[int]) -> int:
    """The key of a block after the prefix keyed ``parent_hash`` (Python's tuple hash: deterministic for ints)."""
    return hash((parent_hash, tuple(block)))


def block_hashes(tokens: Sequence[int], block_tokens: int) -> Iterator[tuple[Sequence[int], int]]:
    """Each full block of ``tokens`` in order with its chain key (the key names the whole prefix up to it)."""
    key = _ROOT_HASH
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        block = tokens[start : start + block_tokens]
        key = chain_hash(key, block)
        yield block, key


@dataclass
class PrefixHit:
    """A lookup's result: the deepest span of the matched path (None: nothing cached) and its length."""

    span: PrefixSpan | None
    tokens: int


class PrefixCache:
    """Block-aligned prompt KV shared by every batch of one runtime, bounded by ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int, block_tokens: int = PREFIX_BLOCK_TOKENS) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.capacity_bytes = capacity_bytes
        self.block_tokens = block_tokens
        self.root_children: dict[int, PrefixSpan] = {}
        self._index: dict[int, tuple[PrefixSpan, int]] = {}  # block key -> (span, block index in the span)
        self._spans: set[PrefixSpan] = set()
        self._serial = itertools.count()
        self.bytes = 0
        self.generation = 0  # bumped whenever a span's tensors are replaced (a split)
        self.lookup_tokens = 0
        self.hit_tokens = 0
        self.evicted_spans = 0

    # -- lookup --------------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int, count: bool = True) -> PrefixHit:
        """The longest cached block-aligned prefix of ``tokens`` of at most ``limit`` tokens, as a path that
        ends exactly at a span boundary (a span is split when the match ends inside it). Marks the path
        used and, with ``count``, counts the lookup in the hit statistics."""
        matched, found = 0, None
        for index, (block, key) in enumerate(block_hashes(tokens[: min(limit, len(tokens))], self.block_tokens)):
            entry = self._index.get(key)
            if entry is None:
                break
            span, at = entry
            lo = at * self.block_tokens
            if span.tokens[lo : lo + self.block_tokens] != tuple(block):
                break  # a hash collision, not a hit
            found, matched = entry, (index + 1) * self.block_tokens
        if count:
            self.lookup_tokens += len(tokens)
            self.hit_tokens += matched
        if found is None:
            return PrefixHit(None, 0)
        span, at = found
        if at + 1 < len(span.hashes):
            self._split(span, at + 1)
            span = span.parent
        assert span is not None
        self._touch(span)
        return PrefixHit(span, matched)

    def _touch(self, span: PrefixSpan) -> None:
        now = time.monotonic()
        for node in span.path():
            node.last_used = now

    # -- references ----------------------------------------------------------------------------------
    @staticmethod
    def acquire(span: PrefixSpan | None) -> None:
        """Pin ``span`` (and so its whole path) against eviction; None is a no-op."""
        if span is not None:
            span.refs += 1

    @staticmethod
    def release(span: PrefixSpan | None) -> None:
        """Drop a pin taken by ``acquire``."""
        if span is not None:
            if span.refs <= 0:
                raise RuntimeError("prefix span released more often than acquired")
            span.refs -= 1

    def pinned_refs(self) -> int:
        """Total references held on spans (0 when no live group uses the cache)."""
        return sum(s.refs for s in self._spans)

    # -- insertion -----------------------------------------------------------------------------------
    def insert(self, hit: PrefixHit, tokens: Sequence[int], keys: Sequence[torch.Tensor],
               values: Sequence[torch.Tensor], room_bytes: int) -> PrefixHit:
        """Cache the full blocks of ``tokens`` after ``hit``: keys/values [Hkv, len(tokens) - hit.tokens, D] are
        the KV of those tokens. Blocks already cached are reused (another request inserted them since the
        match). Stores at most ``room_bytes`` more, after evicting what it must; stores nothing when the
        blocks do not fit. Returns the new deepest span and the cached length."""
        parent, start = hit.span, hit.tokens
        full = len(tokens) // self.block_tokens * self.block_tokens
        key = parent.hashes[-1] if parent is not None else _ROOT_HASH
        while start < full:  # follow blocks that are cached already
            block = tuple(tokens[start : start + self.block_tokens])
            child = (parent.children if parent is not None else self.root_children).get(chain_hash(key, block))
            if child is None or child.tokens[: self.block_tokens] != block:
                break
            blocks = _common_blocks(child.tokens, tokens[start:full], self.block_tokens)
            if blocks < len(child.hashes):
                self._split(child, blocks)
                child = child.parent
            assert child is not None
            parent, key, start = child, child.hashes[-1], start + len(child.tokens)
        if start < full:
            offset = start - hit.tokens
            span_keys = [k[:, offset : offset + full - start].clone() for k in keys]
            span_values = [v[:, offset : offset + full - start].clone() for v in values]
            size = sum(t.numel() * t.element_size() for t in span_keys + span_values)
            short = max(self.bytes + size - self.capacity_bytes, size - room_bytes)
            if short > 0:
                room_bytes += self.evict(short, keep=parent)
            if size <= room_bytes and self.bytes + size <= self.capacity_bytes:
                parent = self._add_span(parent, key, tuple(tokens[start:full]), span_keys, span_values)
                start = full
        if parent is None:
            return PrefixHit(None, 0)
        self._touch(parent)
        return PrefixHit(parent, start)

    def _add_span(self, parent: PrefixSpan | None, key: int, tokens: tuple[int, ...], keys: list[torch.Tensor],
                  values: list[torch.Tensor]) -> PrefixSpan:
        hashes = []
        for lo in range(0, len(tokens), self.block_tokens):
            key = chain_hash(key, tokens[lo : lo + self.block_tokens])
            hashes.append(key)
        span = PrefixSpan(tokens, keys, values, hashes, parent, serial=next(self._serial))
        siblings = parent.children if parent is not None else self.root_children
        siblings[hashes[0]] = span
        for at, block_key in enumerate(hashes):
            self._index[block_key] = (span, at)
        self._spans.add(span)
        self.bytes += span.nbytes()
        return span

    def _split(self, span: PrefixSpan, blocks: int) -> None:
        """Cut ``span`` after ``blocks`` blocks: a new head span takes its place under its parent and ``span``
        keeps the tail (and its children and references). Both get their own contiguous copies."""
        cut = blocks * self.block_tokens
        head = PrefixSpan(span.tokens[:cut], [k[:, :cut].clone() for k in span.keys],
                          [v[:, :cut].clone() for v in span.values], span.hashes[:blocks], span.parent,
                          last_used=span.last_used, serial=next(self._serial))
        span.tokens, span.hashes = span.tokens[cut:], span.hashes[blocks:]
        span.keys = [k[:, cut:].clone() for k in span.keys]
        span.values = [v[:, cut:].clone() for v in span.values]
        siblings = span.parent.children if span.parent is not None else self.root_children
        siblings[head.hashes[0]] = head
        head.children = {span.hashes[0]: span}
        span.parent = head
        for at, block_key in enumerate(head.hashes):
            self._index[block_key] = (head, at)
        for at, block_key in enumerate(span.hashes):
            self._index[block_key] = (span, at)
        self._spans.add(head)
        self.generation += 1

    # -- eviction ------------------------------------------------------------------------------------
    def evict(self, needed_bytes: int, keep: PrefixSpan | None = None) -> int:
        """Free at least ``needed_bytes`` (when possible) by dropping unreferenced leaf spans, least recently
        used first, never ``keep``'s path. Returns the bytes freed."""
        protected = set(keep.path()) if keep is not None else set()
        freed = 0
        while freed < needed_bytes:
            leaves = [s for s in self._spans if not s.children and s.refs == 0 and s not in protected]
            if not leaves:
                break
            victim = min(leaves, key=lambda s: (s.last_used, s.serial))
            freed += self._drop(victim)
        return freed

    def _drop(self, span: PrefixSpan) -> int:
        siblings = span.parent.children if span.parent is not None else self.root_children
        del siblings[span.hashes[0]]
        for block_key in span.hashes:
            del self._index[block_key]
        self._spans.discard(span)
        size = span.nbytes()
        self.bytes -= size
        self.evicted_spans += 1
        return size

    def stats(self) -> dict[str, int]:
        """Bytes held, spans, and the cumulative prompt tokens looked up and found cached."""
        return {"prefix_cache_bytes": self.bytes, "prefix_cache_spans": len(self._spans),
                "prefix_cache_lookup_tokens": self.lookup_tokens, "prefix_cache_hit_tokens": self.hit_tokens}


def _common_blocks(cached: Sequence[int], tokens: Sequence[int], block_tokens: int) -> int:
    """How many leading whole blocks ``tokens`` shares with ``cached``."""
    blocks = 0
    for lo in range(0, min(len(cached), len(tokens)) - block_tokens + 1, block_tokens):
        if tuple(cached[lo : lo + block_tokens]) != tuple(tokens[lo : lo + block_tokens]):
            break
        blocks += 1
    return blocks
