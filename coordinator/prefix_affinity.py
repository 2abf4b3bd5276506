"""Prefix-aware routing: which target replica most likely holds a prompt's prefix in its prefix cache.

The router remembers, per replica, the chain keys of the prompt blocks it sent there (the same keys the
services' prefix caches use, ``engine.prefix_cache.block_hashes``), least recently used first out past a
bound. A new request's match on a replica is the number of its leading blocks remembered there. This is
an estimate (a replica may have evicted a block since), like SGLang's cache-aware router: a wrong guess
costs a prefill, never a wrong token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engine.prefix_cache import block_hashes

MAX_BLOCKS_PER_REPLICA = 1 << 16


class PrefixAffinity:
    """Per-replica memory of routed prompt blocks, bounded by ``max_blocks`` per replica."""

    def __init__(self, block_tokens: int, max_blocks: int = MAX_BLOCKS_PER_REPLICA) -> None:
        if block_tokens < 1 or max_blocks < 1:
            raise ValueError(f"block_tokens and max_blocks must be positive (got {block_tokens}, {max_blocks})")
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def keys(self, prompt: Sequence[int]) -> list[int]:
        """The chain keys of ``prompt``'s full blocks, in order."""
        return [key for _, key in block_hashes(list(prompt), self.block_tokens)]

    def matched_blocks(self, replica: str, keys: Sequence[int]) -> int:
        """How many leading blocks of a prompt (given by its ``keys``) were routed to ``replica``."""
        known = self._blocks.get(replica)
        if not known:
            return 0
        matched = 0
        for key in keys:
            if key not in known:
                break
            matched += 1
        return matched

    def record(self, replica: str, keys: Sequence[int]) -> None:
        """Remember that a prompt with these block ``keys`` went to ``replica`` (most recently used)."""
        known = self._blocks.setdefault(replica, OrderedDict())
        for key in keys:
            known[key] = None
            known.move_to_end(key)
        while len(known) > self.max_blocks:
            known.popitem(last=False)

    def forget(self, replica: str) -> None:
        """Drop everything remembered for a replica that left."""
        self._blocks.pop(replica, None)
