"""The prefix cache across requests: block matching, splits, references, LRU eviction, and exact decoding
(cache on vs off vs HF generate) with three-level cascade attention, in both KV layouts."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
from hf_oracle import greedy

from engine.batch import GroupInput
from engine.checkpoint import load_checkpoint
from engine.draft import DraftRuntime
from engine.errors import InvalidInput
from engine.prefix_cache import PrefixCache, PrefixHit
from engine.sampling import SamplingParams
from engine.target import TargetRuntime

BLOCK = 4
SYSTEM = [7, 3, 9, 11, 40, 2, 5, 8, 13, 21, 34, 55, 6]  # 13 tokens: 3 whole blocks and a partial one


def _kv(tokens: int, layers: int = 2, fill: float = 0.0) -> list[torch.Tensor]:
    return [torch.full((1, tokens, 2), fill + layer) for layer in range(layers)]


def test_match_splits_spans_and_reuses_inserted_blocks():
    cache = PrefixCache(1 << 20, block_tokens=BLOCK)
    a = list(range(100, 112))  # 3 blocks
    inserted = cache.insert(PrefixHit(None, 0), a, _kv(12), _kv(12), room_bytes=1 << 20)
    assert inserted.tokens == 12 and cache.stats()["prefix_cache_spans"] == 1
    b = a[:8] + [1, 2, 3, 4, 5]
    hit = cache.match(b, limit=len(b) - 1)
    assert hit.tokens == 8 and hit.span is not None and hit.span.tokens == tuple(a[:8])
    assert cache.stats()["prefix_cache_spans"] == 2  # split at the divergence, both halves contiguous
    assert [len(s.tokens) for s in inserted.span.path()] == [8, 4]
    assert torch.equal(inserted.span.keys[1], _kv(12)[1][:, 8:])
    grown = cache.insert(hit, b, _kv(5, fill=9), _kv(5, fill=9), room_bytes=1 << 20)
    assert grown.tokens == 12 and grown.span.path()[0] is hit.span  # one block after the shared 8
    again = cache.match(b, limit=len(b))
    assert again.span is grown.span and again.tokens == 12
    assert cache.match([100, 101, 102, 999], limit=4).tokens == 0  # a differing block is a miss
    stats = cache.stats()
    assert stats["prefix_cache_hit_tokens"] == 8 + 12 and stats["prefix_cache_lookup_tokens"] == 13 + 13 + 4


def test_eviction_is_lru_over_unreferenced_leaves():
    cache = PrefixCache(1 << 20, block_tokens=BLOCK)
    spans = [cache.insert(PrefixHit(None, 0), [t] * 8, _kv(8), _kv(8), 1 << 20).span for t in (1, 2, 3)]
    size = spans[0].nbytes()
    cache.acquire(spans[0])
    cache.match([2] * 8, limit=8)  # spans[1] is now more recent than spans[2]
    assert cache.evict(1) == size and cache.stats()["prefix_cache_spans"] == 2
    assert cache.match([3] * 8, limit=8).tokens == 0  # the least recently used free leaf went first
    assert cache.evict(10 * size) == size  # the pinned span stays
    assert cache.match([1] * 8, limit=8).tokens == 8
    cache.release(spans[0])
    assert cache.pinned_refs() == 0 and cache.evict(size) == size and cache.bytes == 0
    with pytest.raises(RuntimeError):
        cache.release(spans[0])


def test_insert_respects_room_and_capacity():
    cache = PrefixCache(1 << 20, block_tokens=BLOCK)
    size = sum(t.numel() * t.element_size() for t in _kv(8) + _kv(8))
    assert cache.insert(PrefixHit(None, 0), [1] * 8, _kv(8), _kv(8), room_bytes=size - 1).span is None
    assert cache.bytes == 0
    small = PrefixCache(size, block_tokens=BLOCK)
    first = small.insert(PrefixHit(None, 0), [1] * 9, _kv(9), _kv(9), room_bytes=1 << 20)
    assert first.tokens == 8  # the partial last block is not cached
    second = small.insert(PrefixHit(None, 0), [2] * 8, _kv(8), _kv(8), room_bytes=1 << 20)
    assert second.tokens == 8 and small.bytes == size  # the first span was evicted to make room
    assert small.match([1] * 8, limit=8).tokens == 0


def test_prefill_with_past_equals_a_full_prefill(checkpoints):
    runtime = TargetRuntime(load_checkpoint(checkpoints["qwen2"]))
    prompt = SYSTEM + [60, 61, 62, 63, 64]
    logits, keys, values = runtime.decoder.prefill(prompt)
    head_logits, head_k, head_v = runtime.decoder.prefill(prompt[:8])
    tail_logits, tail_k, tail_v = runtime.decoder.prefill(prompt[8:], (head_k, head_v))
    torch.testing.assert_close(tail_logits, logits, atol=1e-5, rtol=1e-5)
    for layer in range(len(keys)):
        torch.testing.assert_close(torch.cat([head_k[layer], tail_k[layer]], dim=1), keys[layer])


def _decode(runtime: TargetRuntime, batch_id: str, sequence_ids: Iterable[int], out: dict[int, list[int]],
            steps: int = 1) -> None:
    """Run ``steps`` plain decode steps (no draft tokens) of the listed sequences, appending each one's next
    token to ``out``."""
    for _ in range(steps):
        for verdict in runtime.verify(batch_id, {sid: ([], []) for sid in sequence_ids}):
            out[verdict.sequence_id].append(verdict.next_token_id)


def _requests() -> list[list[int]]:
    """Prompts in Hydragen's tree: a system prompt, two problems below it, samples below each, and the
    awkward cases (a prompt that is a prefix of a cached one; a whole-block prompt cached entirely)."""
    problem_a, problem_b = SYSTEM + [60, 61, 62, 63, 64, 65], SYSTEM + [70, 71, 72]
    return [problem_a, problem_b, problem_a, SYSTEM[:9], SYSTEM[:12], SYSTEM[:12]]


@pytest.mark.parametrize("model,attention,backend", [("qwen2", "bifurcated", "torch"), ("llama", "bifurcated", "torch"),
                                                     ("qwen2", "bifurcated", "triton"), ("llama", "standard", "torch")])
def test_cached_prefixes_decode_exactly_as_hf_generate(checkpoints, model, attention, backend):
    """Triton runs in its CPU interpreter here (TRITON_INTERPRET=1, set by conftest)."""
    runtime = TargetRuntime(load_checkpoint(checkpoints[model]), attention=attention, attention_backend=backend,
                            prefix_cache_bytes=1 << 24, prefix_block_tokens=BLOCK)
    out: dict[int, list[int]] = {}
    cached: dict[int, int] = {}
    prompts = _requests()
    for g, prompt in enumerate(prompts):  # groups join one at a time, each reusing what the earlier ones cached
        done = runtime.prefill("b", [GroupInput(g, prompt, [10 * g, 10 * g + 1], SamplingParams(), 24)])
        out.update({sid: [token] for sid, token in done.first_tokens.items()})
        cached.update(done.cached_tokens)
        _decode(runtime, "b", out, out)
    _decode(runtime, "b", out, out, steps=8)
    assert cached == {0: 0, 1: 12, 2: 16, 3: 8, 4: 11, 5: 11}  # 4, 5: wholly cached, the last position computed
    for g, prompt in enumerate(prompts):
        expected = greedy(checkpoints[model], prompt, len(out[10 * g]), None)
        assert out[10 * g] == expected and out[10 * g + 1] == expected
    stats = runtime.stats()
    assert stats["prefix_cache_refs"] == len(prompts)
    runtime.release("b", [0, 1, 20, 21])  # two groups leave: their pins go, the others' stay
    assert runtime.stats()["prefix_cache_refs"] == len(prompts) - 2
    runtime.release("b")
    assert runtime.stats()["prefix_cache_refs"] == 0 and runtime.stats()["kv_reserved_bytes"] == 0


def test_a_repeated_whole_block_prompt_reuses_its_span_without_a_split(checkpoints):
    """A prompt cached entirely (a retry, or more samples of one prompt) reads all of it from its span and
    computes only its last position for the logits: the span is not cut before its last block, and the
    repeat decodes as HF generate does."""
    runtime = TargetRuntime(load_checkpoint(checkpoints["llama"]), prefix_cache_bytes=1 << 24,
                            prefix_block_tokens=BLOCK)
    prompt = SYSTEM[:12]  # three whole blocks, inserted as one span by the first group
    out: dict[int, list[int]] = {}
    for g in range(2):
        done = runtime.prefill("b", [GroupInput(g, prompt, [g], SamplingParams(), 8)])
        out.update({sid: [token] for sid, token in done.first_tokens.items()})
        assert done.cached_tokens == {g: 11 * g}
        assert runtime.stats()["prefix_cache_spans"] == 1
    _decode(runtime, "b", out, out, steps=6)
    expected = greedy(checkpoints["llama"], prompt, 7, None)
    assert out == {0: expected, 1: expected}
    assert runtime.stats()["prefix_cache_hit_tokens"] == 12
    runtime.release("b")
    assert runtime.stats()["prefix_cache_refs"] == 0


def test_sampled_outputs_are_unchanged_by_the_cache(checkpoints):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    outputs = []
    for cache_bytes in (0, 1 << 24):
        runtime = TargetRuntime(load_checkpoint(checkpoints["qwen2"]), prefix_cache_bytes=cache_bytes,
                                prefix_block_tokens=BLOCK)
        out: dict[int, list[int]] = {}
        for g, prompt in enumerate(_requests()[:3]):
            done = runtime.prefill(f"b{g}", [GroupInput(g, prompt, [10 * g + i for i in range(4)], params, 16)])
            out.update({sid: [t] for sid, t in done.first_tokens.items()})
            _decode(runtime, f"b{g}", done.first_tokens, out, steps=10)
        outputs.append(out)
    assert outputs[0] == outputs[1]  # same seeds, same distributions: the same samples


def test_eviction_under_a_small_budget_while_requests_run(checkpoints):
    runtime = TargetRuntime(load_checkpoint(checkpoints["llama"]), prefix_cache_bytes=1 << 24,
                            prefix_block_tokens=BLOCK)
    # two live requests (a 16-token prompt, 2 samples, 8 new tokens each) and half a free cached span
    runtime.kv_budget_bytes = 2 * runtime.group_kv_bytes(16, 2, 8) + 8 * runtime.token_kv_bytes
    prompts = [[t] * 12 + [t + 1, t + 2, t + 3, t + 4] for t in (30, 50, 70, 90)]
    out: dict[int, list[int]] = {}
    live: dict[str, list[int]] = {}
    for g, prompt in enumerate(prompts):
        batch = f"b{g}"
        done = runtime.prefill(batch, [GroupInput(g, prompt, [10 * g, 10 * g + 1], SamplingParams(), 8)])
        out.update({sid: [t] for sid, t in done.first_tokens.items()})
        live[batch] = list(done.first_tokens)
        stats = runtime.stats()
        assert stats["kv_reserved_bytes"] + stats["prefix_cache_bytes"] <= runtime.kv_budget_bytes
        for batch_id, sids in live.items():
            _decode(runtime, batch_id, sids, out)
        if len(live) == 2:  # the oldest request finishes: its span becomes evictable
            oldest = next(iter(live))
            runtime.release(oldest)
            del live[oldest]
    assert runtime.prefix_cache.evicted_spans >= 1
    for g, prompt in enumerate(prompts):
        expected = greedy(checkpoints["llama"], prompt, len(out[10 * g]), None)
        assert out[10 * g] == expected
    for batch_id in list(live):
        runtime.release(batch_id)
    assert runtime.stats()["prefix_cache_refs"] == 0


def test_a_live_group_id_cannot_be_prefilled_again(checkpoints):
    """A group id is its reservation's and its span pin's key in a batch: reusing a live one is refused with
    nothing changed, and allowed again once the group is released."""
    runtime = TargetRuntime(load_checkpoint(checkpoints["llama"]), prefix_cache_bytes=1 << 24,
                            prefix_block_tokens=BLOCK)
    prompt = [40 + i for i in range(20)]
    runtime.prefill("b", [GroupInput(1, prompt, [10, 11], SamplingParams(), 8)])
    before = runtime.stats()
    def group(group_id: int, sequence_id: int) -> GroupInput:
        return GroupInput(group_id, prompt, [sequence_id], SamplingParams(), 8)

    for groups in ([group(1, 12)], [group(2, 13), group(2, 14)]):
        with pytest.raises(InvalidInput, match="already live"):
            runtime.prefill("b", groups)
        assert runtime.stats() == before
    runtime.release("b", [10, 11])
    assert runtime.stats()["prefix_cache_refs"] == 0
    assert list(runtime.prefill("b", [group(1, 12)]).first_tokens) == [12]


def test_draft_proposals_are_unchanged_by_its_cache(checkpoints):
    """A draft that reads a request's prompt from its prefix cache proposes the tokens, and sends the
    distributions, that it proposes with the cache off (sampled, seeded, k = 3, every proposal accepted)."""
    params = SamplingParams(temperature=0.8, seed=4)
    runs = []
    for cache_bytes in (0, 1 << 24):
        draft = DraftRuntime(load_checkpoint(checkpoints["llama_draft"]), prefix_cache_bytes=cache_bytes,
                             prefix_block_tokens=BLOCK, confidence_floor=0.0)
        vocab = draft.checkpoint.vocab_size
        draft.prefill("earlier", [GroupInput(0, SYSTEM + [90], [0], params, 8)])
        draft.release("earlier")
        draft.prefill("b", [GroupInput(1, SYSTEM + [60, 61, 62], [10, 11], params, 16)])
        updates = {sid: (0, 70 + sid, []) for sid in (10, 11)}
        proposals = []
        for _ in range(3):
            round_ = draft.propose("b", updates, draft_len=3)
            proposals.append([(p.token_ids, [d.to_dense(vocab) for d in p.distributions]) for p in round_])
            updates = {p.sequence_id: (len(p.token_ids), 5, []) for p in round_}
        runs.append((proposals, draft.stats()["prefix_cache_hit_tokens"]))
        draft.release("b")
    (off, off_hits), (on, on_hits) = runs
    assert (off_hits, on_hits) == (0, 12)
    for round_off, round_on in zip(off, on, strict=True):
        for (tokens_off, dists_off), (tokens_on, dists_on) in zip(round_off, round_on, strict=True):
            assert tokens_on == tokens_off
            for p_off, p_on in zip(dists_off, dists_on, strict=True):
                torch.testing.assert_close(p_on, p_off)


def test_groups_sharing_a_cached_prefix_are_placed_next_to_each_other(checkpoints):
    """Requests with two system prompts arrive interleaved (S1, S2, S1): the second S1 group's rows go
    right after the first's, so each cached span is read by one contiguous run of rows (one context read
    per span and layer), and every group still decodes as HF generate does."""
    runtime = TargetRuntime(load_checkpoint(checkpoints["llama"]), prefix_cache_bytes=1 << 24,
                            prefix_block_tokens=BLOCK)
    first, second = SYSTEM[:8], [50 + i for i in range(8)]  # two system prompts of two blocks each
    prompts = [first + [60, 61], second + [70], first + [80, 81, 82]]
    out: dict[int, list[int]] = {}
    for g, prompt in enumerate(prompts):
        done = runtime.prefill("b", [GroupInput(g, prompt, [10 * g, 10 * g + 1], SamplingParams(), 12)])
        out.update({sid: [token] for sid, token in done.first_tokens.items()})
    assert done.cached_tokens == {2: 8}
    layout = runtime.batches["b"].kv
    assert [s.group_id for s in runtime.batches["b"].sequences] == [0, 0, 2, 2, 1, 1]
    assert [(len(span.tokens), lo, hi) for span, lo, hi in layout._cascade_plan().spans] == [(8, 0, 4), (8, 4, 6)]
    _decode(runtime, "b", out, out, steps=8)
    for g, prompt in enumerate(prompts):
        expected = greedy(checkpoints["llama"], prompt, len(out[10 * g]), None)
        assert out[10 * g] == expected and out[10 * g + 1] == expected, g
    runtime.release("b", [20, 21])  # the middle group leaves: the others keep their rows and outputs
    _decode(runtime, "b", (0, 1, 10, 11), out)
    for g in (0, 1):
        assert out[10 * g] == greedy(checkpoints["llama"], prompts[g], len(out[10 * g]), None)
    runtime.release("b")
    assert runtime.stats()["prefix_cache_refs"] == 0
