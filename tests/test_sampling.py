"""Tests of engine.sampling: logits processing, compact draft distributions and lossless verification.

The distribution-exactness tests simulate the whole speculative loop on a synthetic Markov "model" (the
next-token logits depend on the previous token through a fixed random table; the draft has its own,
different table), run it for thousands of independent samples batched together, and compare the emitted
tokens with the exact target distribution by a chi-square test. The same statistic must reject a
deliberately broken acceptance rule.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from engine import sampling
from engine.sampling import (
    CompactDistribution,
    SamplingParams,
    compact_distribution,
    draft_distribution,
    greedy_accept,
    process_logits,
    sample,
    sequence_generator,
    verify_proposals,
    verify_windows,
)

ALPHA = 1e-3


# --------------------------------------------------------------------------------------------------------
# SamplingParams / generators
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
        ({"temperature": 1.0, "top_p": math.nan}, "top_p"),
        ({"temperature": 1.0, "top_k": -1}, "top_k"),
    ],
)
def test_validate_rejects_bad_params(kwargs: dict, field: str) -> None:
    params = SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=field):
        params.validate()
    with pytest.raises(ValueError, match=field):
        process_logits(torch.zeros(1, 4), [params])


def test_validate_accepts_good_params_and_greedy_flag() -> None:
    for p in (SamplingParams(), SamplingParams(0.7, 0.9, 40, 3), SamplingParams(1.0, 1.0, 0)):
        p.validate()
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.5).greedy


def test_sequence_generator_is_stable_and_independent() -> None:
    def draws(seed: int, index: int, role: str) -> torch.Tensor:
        return torch.rand(4, generator=sequence_generator(seed, index, role), dtype=torch.float64)

    assert torch.equal(draws(7, 3, "draft"), draws(7, 3, "draft"))
    others = [draws(8, 3, "draft"), draws(7, 4, "draft"), draws(7, 3, "target")]
    assert all(not torch.equal(draws(7, 3, "draft"), o) for o in others)
    with pytest.raises(ValueError, match="role"):
        sequence_generator(7, 3, "oracle")


# --------------------------------------------------------------------------------------------------------
# process_logits
# --------------------------------------------------------------------------------------------------------


def _logits(n: int, v: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_temperature_matches_softmax(temperature: float) -> None:
    logits = _logits(4, 50)
    probs = process_logits(logits, [SamplingParams(temperature=temperature)] * 4)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, dim=-1), rtol=1e-5, atol=1e-7)


def test_top_k_keeps_exactly_k_most_probable() -> None:
    logits = _logits(6, 40, seed=1)
    probs = process_logits(logits, [SamplingParams(temperature=1.0, top_k=5)] * 6)
    assert ((probs > 0).sum(-1) == 5).all()
    top5 = logits.topk(5, dim=-1).indices
    assert torch.equal(torch.sort(probs.topk(5, dim=-1).indices).values, torch.sort(top5).values)
    expected = torch.zeros_like(probs).scatter_(-1, top5, torch.softmax(logits.gather(-1, top5), -1))
    torch.testing.assert_close(probs, expected)


def test_top_k_ties_break_toward_lower_ids() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0, 0.0]])
    probs = process_logits(logits, [SamplingParams(temperature=1.0, top_k=2)])
    assert (probs[0] > 0).nonzero().flatten().tolist() == [1, 3]


@pytest.mark.parametrize("top_p", [0.3, 0.8, 0.95])
def test_top_p_keeps_minimal_nucleus(top_p: float) -> None:
    logits = _logits(8, 40, seed=2)
    probs = process_logits(logits, [SamplingParams(temperature=1.0, top_p=top_p)] * 8)
    full = torch.softmax(logits.double(), dim=-1)
    for row in range(8):
        ranked = torch.sort(full[row], descending=True)
        mass = ranked.values.cumsum(0)
        m = int((probs[row] > 0).sum())
        assert mass[m - 1] >= top_p - 1e-6  # the kept prefix reaches top_p ...
        assert m == 1 or mass[m - 2] < top_p  # ... and is the shortest one that does
        kept = ranked.indices[:m]
        assert set(kept.tolist()) == set((probs[row] > 0).nonzero().flatten().tolist())
        torch.testing.assert_close(probs[row, kept].double(), full[row, kept] / full[row, kept].sum())


def test_top_p_one_token_when_dominant() -> None:
    probs = process_logits(torch.tensor([[10.0, 0.0, 0.0]]), [SamplingParams(temperature=1.0, top_p=0.5)])
    assert probs.tolist() == [[1.0, 0.0, 0.0]]


def test_top_k_then_top_p_combined() -> None:
    logits = _logits(5, 60, seed=3)
    probs = process_logits(logits, [SamplingParams(temperature=0.9, top_k=10, top_p=0.7)] * 5)
    k_only = process_logits(logits, [SamplingParams(temperature=0.9, top_k=10)] * 5).double()
    for row in range(5):
        ranked = torch.sort(k_only[row], descending=True).values
        m = int((probs[row] > 0).sum())
        assert 1 <= m <= 10
        assert ranked[:m].sum() >= 0.7 - 1e-6 and (m == 1 or ranked[: m - 1].sum() < 0.7)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))


def test_greedy_is_one_hot_of_argmax_lowest_tie() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 5.0]], dtype=torch.bfloat16)
    probs = process_logits(logits, [SamplingParams()] * 2)
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_mixed_rows_deterministic_and_match_single_row_processing() -> None:
    logits = _logits(6, 64, seed=4).to(torch.float16)
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.2, top_k=7),
        SamplingParams(temperature=1.0, top_p=0.6),
        SamplingParams(temperature=0.5, top_k=20, top_p=0.9),
        SamplingParams(),
    ]
    a = process_logits(logits, params)
    b = process_logits(logits.clone(), list(params))
    assert torch.equal(a, b)  # bit-for-bit
    for row, p in enumerate(params):
        torch.testing.assert_close(a[row : row + 1], process_logits(logits[row : row + 1], [p]))
    torch.testing.assert_close(a.sum(-1), torch.ones(6))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    temperature=st.floats(0.05, 5.0),
    top_k=st.integers(0, 40),
    top_p=st.floats(0.01, 1.0),
)
def test_process_logits_properties(seed: int, temperature: float, top_k: int, top_p: float) -> None:
    logits = _logits(3, 32, seed=seed)
    probs = process_logits(logits, [SamplingParams(temperature, top_p, top_k)] * 3)
    assert (probs >= 0).all() and torch.allclose(probs.sum(-1), torch.ones(3))
    assert (probs.gather(-1, logits.argmax(-1, keepdim=True)) > 0).all()  # top-1 always kept
    if top_k:
        assert ((probs > 0).sum(-1) <= top_k).all()
    kept_min = torch.where(probs > 0, logits, torch.inf).amin(-1)
    dropped_max = torch.where(probs > 0, -torch.inf, logits).amax(-1)
    assert (kept_min >= dropped_max).all()  # the kept set is a top set


def test_tiny_temperature_does_not_overflow() -> None:
    probs = process_logits(torch.tensor([[1.0, 3.0, 2.0]]), [SamplingParams(temperature=1e-30)])
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


def _sorted_filter(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The definition of top-k then top-p on one row by a stable sort of the whole row: the oracle (masses
    summed in float64, in rank order, the row's in id order)."""
    ranked, order = torch.sort(probs, descending=True, stable=True)
    if top_k:
        ranked = ranked * (torch.arange(probs.numel()) < top_k)
    mass = ranked.double().cumsum(0)
    total = mass[-1] if top_k else probs.double().cumsum(0)[-1]
    before = torch.cat([mass.new_zeros(1), mass[:-1]])
    kept = (ranked * (before < top_p * total)).double()
    return torch.zeros_like(probs).scatter_(0, order, (kept / kept.cumsum(0)[-1]).float())


def _row_cases() -> list[tuple[torch.Tensor, int, float]]:
    """Rows that the first candidates decide and rows they do not: peaked and flat logits, ties across the
    k-th rank and across the nucleus' end, a nucleus near the whole row, the default target's vocabulary."""
    g = torch.Generator().manual_seed(7)
    cases = []
    for vocab in (49152, 7169, 50):
        for scale in (0.3, 3.0, 12.0):
            logits = torch.randn(vocab, generator=g) * scale
            for top_k, top_p in ((0, 0.95), (0, 0.5), (0, 0.999), (5, 1.0), (40, 0.9), (1000, 0.95)):
                cases.append((logits, min(top_k, vocab - 1), top_p))
                cases.append(((logits * 2).round() / 2, min(top_k, vocab - 1), top_p))  # many ties
    uniform = torch.zeros(49152)
    cases += [(uniform, 0, 0.5), (uniform, 100, 0.3), (uniform, 0, 0.9999)]  # every token tied
    return cases


def test_top_k_top_p_equal_a_sort_of_the_whole_row_bit_for_bit() -> None:
    cases = _row_cases()
    expected = [_sorted_filter(torch.softmax(logits, -1), k, p) for logits, k, p in cases]
    for (logits, k, p), want in zip(cases, expected, strict=True):
        got = process_logits(logits[None], [SamplingParams(temperature=1.0, top_k=k, top_p=p)])[0]
        assert torch.equal(got, want), (logits.numel(), k, p)
    for vocab in (49152, 7169, 50):  # one batch of mixed rows gives each row what it gets alone
        batch = [(logits, k, p) for logits, k, p in cases if logits.numel() == vocab]
        got = process_logits(torch.stack([logits for logits, _, _ in batch]),
                             [SamplingParams(temperature=1.0, top_k=k, top_p=p) for _, k, p in batch])
        want = torch.stack([w for w, (logits, _, _) in zip(expected, cases, strict=True) if logits.numel() == vocab])
        assert torch.equal(got, want)
        # ... also beside a row that filters nothing and a greedy row (only the filtered rows are filtered)
        plain = batch[0][0]
        got = process_logits(torch.stack([plain, *[logits for logits, _, _ in batch], plain]),
                             [SamplingParams(temperature=1.0), *[SamplingParams(temperature=1.0, top_k=k, top_p=p)
                                                                 for _, k, p in batch], SamplingParams()])
        assert torch.equal(got[0], torch.softmax(plain, -1)) and torch.equal(got[1:-1], want)
        assert got[-1].tolist() == torch.nn.functional.one_hot(plain.argmax(), vocab).float().tolist()

# --------------------------------------------------------------------------------------------------------
# sample
# --------------------------------------------------------------------------------------------------------


def test_sample_consumes_one_uniform_and_never_returns_zero_prob() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]])
    gens = [sequence_generator(1, i, "draft") for i in range(2)]
    twins = [sequence_generator(1, i, "draft") for i in range(2)]
    for _ in range(200):
        out = sample(probs, gens)
        assert out.dtype == torch.int64
        assert out[0].item() in (1, 3) and out[1].item() == 2
        for t in twins:
            torch.rand(1, generator=t, dtype=torch.float64)
    assert all(torch.equal(g.get_state(), t.get_state()) for g, t in zip(gens, twins, strict=True))


def test_inverse_cdf_clamps_rounding_past_the_end() -> None:
    probs = torch.tensor([[0.3, 0.3, 0.3, 0.0, 0.0]])  # sums to < 1 in float32; trailing zeros
    u = torch.tensor([1.0 - 2.0**-53], dtype=torch.float64)
    assert sampling._inverse_cdf(probs, u).tolist() == [2]
    assert sampling._inverse_cdf(probs, torch.zeros(1, dtype=torch.float64)).tolist() == [0]


def test_sample_matches_distribution() -> None:
    probs = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.4])
    gen = [sequence_generator(5, 0, "target")]
    counts = np.bincount([int(sample(probs[None], gen)) for _ in range(4000)], minlength=5)
    assert counts[1] == 0
    assert _chi_square_pvalue(counts, probs.double().numpy()) > ALPHA


# --------------------------------------------------------------------------------------------------------
# compact distributions
# --------------------------------------------------------------------------------------------------------


def test_compact_distribution_round_trip() -> None:
    probs = torch.softmax(_logits(1, 1000, seed=5)[0] * 0.7, dim=-1)
    compact = compact_distribution(probs, max_support=64)
    s = compact.token_ids.size
    assert compact.token_ids.dtype == np.int32 and 1 <= s <= 64
    assert len(compact.probs_fp16) == 2 * s and compact.token_ids.nbytes + len(compact.probs_fp16) == 6 * s
    dense = compact.to_dense(1000)
    assert dense.dtype == torch.float32 and dense.shape == (1000,)
    assert abs(dense.double().sum().item() - 1.0) < 1e-6
    assert set((dense > 0).nonzero().flatten().tolist()) == set(compact.token_ids.tolist())
    assert (probs[torch.from_numpy(compact.token_ids).long()] >= 1e-4).all()
    top = torch.topk(probs, s).indices
    assert set(top.tolist()) == set(compact.token_ids.tolist())  # the most probable ones
    again = CompactDistribution(compact.token_ids.copy(), bytes(compact.probs_fp16))
    assert torch.equal(dense, again.to_dense(1000))  # deterministic from the bytes


def test_compact_distribution_keeps_top1_and_respects_min_prob() -> None:
    flat = torch.full((50000,), 1 / 50000)
    compact = compact_distribution(flat)
    assert compact.token_ids.size == 1  # every prob < min_prob: only the top-1 survives
    assert compact.to_dense(50000).sum().item() == 1.0
    one_hot = torch.zeros(10)
    one_hot[7] = 1.0
    assert compact_distribution(one_hot).token_ids.tolist() == [7]


def test_draft_distribution() -> None:
    probs = torch.softmax(_logits(1, 30, seed=6)[0], dim=-1)
    q, compact = draft_distribution(probs, greedy=False)
    assert compact is not None and torch.equal(q, compact.to_dense(30))
    q, compact = draft_distribution(probs, greedy=True)
    assert compact is None and q is probs


def test_to_dense_rejects_malformed() -> None:
    ids = np.array([1, 2], dtype=np.int32)
    good = np.array([0.5, 0.5], dtype="<f2").tobytes()
    with pytest.raises(ValueError):
        CompactDistribution(ids, good[:2]).to_dense(4)
    with pytest.raises(ValueError):
        CompactDistribution(np.array([1, 9], dtype=np.int32), good).to_dense(4)
    with pytest.raises(ValueError):
        CompactDistribution(np.array([1, 1], dtype=np.int32), good).to_dense(4)


# --------------------------------------------------------------------------------------------------------
# verify_proposals: greedy and determinism
# --------------------------------------------------------------------------------------------------------


def _one_hot_window(argmaxes: list[list[int]], vocab: int) -> torch.Tensor:
    idx = torch.tensor(argmaxes)
    return torch.zeros(*idx.shape, vocab).scatter_(-1, idx.unsqueeze(-1), 1.0)


def test_greedy_accepts_matching_prefix() -> None:
    vocab = 10
    target = _one_hot_window([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 3, 4]], vocab)
    tokens = torch.tensor([[1, 2, 3], [1, 9, 3], [1, 2, 9], [0, 0, 0], [1, 2, 9]])
    lens = torch.tensor([3, 3, 3, 0, 2])  # row 3: plain decode; row 4: padding mismatch is ignored
    greedy = torch.ones(5, dtype=torch.bool)
    gens = [sequence_generator(0, i, "target") for i in range(5)]
    states = [g.get_state() for g in gens]
    accepted, nxt = verify_proposals(target, tokens, lens, None, greedy, gens)
    assert accepted.tolist() == [3, 1, 2, 0, 2]
    assert nxt.tolist() == [4, 2, 3, 5, 3]
    assert accepted.dtype == torch.int64 and nxt.dtype == torch.int64
    assert all(torch.equal(s, g.get_state()) for s, g in zip(states, gens, strict=True))  # no draws


def test_greedy_accept_from_argmax_equals_verify_on_one_hots() -> None:
    """greedy_accept on the argmax tokens decides exactly what verify_proposals decides on the one-hot
    distributions process_logits makes of the same logits (random logits, ties included, ragged lengths)."""
    gen = torch.Generator().manual_seed(7)
    for trial in range(20):
        batch, k_max, vocab = 6, 4, 5
        logits = torch.randint(0, 3, (batch, k_max + 1, vocab), generator=gen).float()  # many ties
        lens = torch.randint(0, k_max + 1, (batch,), generator=gen)
        top = logits.argmax(dim=-1)
        tokens = torch.where(torch.rand(batch, k_max, generator=gen) < 0.7, top[:, :k_max],
                             torch.randint(0, vocab, (batch, k_max), generator=gen))
        probs = process_logits(logits.view(-1, vocab), [SamplingParams()] * (batch * (k_max + 1)))
        expected = verify_proposals(probs.view(batch, k_max + 1, vocab), tokens, lens, None,
                                    torch.ones(batch, dtype=torch.bool),
                                    [sequence_generator(0, i, "target") for i in range(batch)])
        got = greedy_accept(top, tokens, lens)
        assert [t.tolist() for t in got] == [t.tolist() for t in expected], trial


def test_empty_window_and_mixed_greedy_sampling_rows() -> None:
    vocab = 6
    target = torch.softmax(_logits(2, vocab, seed=7), -1).unsqueeze(1)  # K = 0
    accepted, nxt = verify_proposals(
        target,
        torch.zeros(2, 0, dtype=torch.long),
        torch.zeros(2, dtype=torch.long),
        None,
        torch.tensor([True, False]),
        [sequence_generator(0, i, "target") for i in range(2)],
    )
    assert accepted.tolist() == [0, 0]
    assert nxt[0].item() == target[0, 0].argmax().item()
    assert target[1, 0, nxt[1]].item() > 0


def test_sampling_row_rejects_token_with_zero_draft_prob_and_needs_q() -> None:
    target = torch.full((1, 2, 4), 0.25)
    q = torch.tensor([[[0.0, 0.5, 0.5, 0.0]]])
    for seed in range(20):
        gen = [sequence_generator(seed, 0, "target")]
        accepted, nxt = verify_proposals(
            target, torch.tensor([[0]]), torch.tensor([1]), q, torch.tensor([False]), gen
        )
        assert accepted.item() == 0 and nxt.item() in (0, 3)  # residual max(0, p - q) lives on {0, 3}
    with pytest.raises(ValueError, match="draft_probs"):
        verify_proposals(target, torch.tensor([[0]]), torch.tensor([1]), None, torch.tensor([False]), gen)


def _random_verify_inputs(batch: int, k: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(batch, k + 1, vocab, generator=g) * 2, -1)
    draft = torch.softmax(torch.randn(batch, k, vocab, generator=g) * 2, -1)
    tokens = torch.multinomial(draft.reshape(-1, vocab), 1, generator=g).reshape(batch, k)
    lens = torch.randint(0, k + 1, (batch,), generator=g)
    greedy = torch.rand(batch, generator=g) < 0.3
    return target, tokens, lens, draft, greedy


def test_verify_is_deterministic_and_rows_are_independent() -> None:
    k, vocab = 4, 12
    target, tokens, lens, draft, greedy = _random_verify_inputs(5, k, vocab, seed=8)
    greedy[2] = False
    lens[2] = 3

    def run(rows: list[int], seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        gens = [sequence_generator(s, 0, "target") for s in seeds]
        return verify_proposals(target[rows], tokens[rows], lens[rows], draft[rows], greedy[rows], gens)

    for trial in range(30):
        seeds = [100 * trial + i for i in range(5)]
        full = run(list(range(5)), seeds)
        assert all(torch.equal(a, b) for a, b in zip(full, run(list(range(5)), seeds), strict=True))
        alone = run([2], [seeds[2]])
        assert full[0][2] == alone[0][0] and full[1][2] == alone[1][0]
        # also independent of the other rows' contents and generators
        other = run([0, 1, 2, 3, 4], [9999, 9998, seeds[2], 9997, 9996])
        assert other[0][2] == alone[0][0] and other[1][2] == alone[1][0]


def _recording(asked: set[tuple[int, int]], probs: torch.Tensor):
    """A ``verify_windows`` distribution source over dense ``probs`` that notes each (row, position) asked for."""
    def rows_at(rows: torch.Tensor, position: int) -> torch.Tensor:
        asked.update((row, position) for row in rows.tolist())
        return probs[rows, position]
    return rows_at


def test_verify_windows_builds_only_the_positions_a_sampling_row_reaches() -> None:
    """The lazy verify decides what the dense one decides, bit for bit, and asks for a sampling row's target
    distributions at positions 0..accepted_len only and for its draft's at the positions it tested (a rejection
    or the bonus ends the row); greedy rows are asked for at every position (their argmax)."""
    k, vocab = 4, 9
    for trial in range(40):
        target, tokens, lens, draft, greedy = _random_verify_inputs(6, k, vocab, seed=100 + trial)
        tokens[:, :2] = target[:, :2].argmax(dim=-1)  # some long accepted prefixes
        asked: dict[str, set[tuple[int, int]]] = {"target": set(), "draft": set()}
        seeds = [sequence_generator(trial, i, "target") for i in range(6)]
        twins = [sequence_generator(trial, i, "target") for i in range(6)]
        lazy = verify_windows(_recording(asked["target"], target), _recording(asked["draft"], draft), tokens, lens,
                              greedy, seeds, vocab)
        dense = verify_proposals(target, tokens, lens, draft, greedy, twins)
        assert [t.tolist() for t in lazy] == [t.tolist() for t in dense], trial
        accepted = lazy[0].tolist()
        for row in range(6):
            reached = range(k + 1) if greedy[row] else range(accepted[row] + 1)
            assert {at for r, at in asked["target"] if r == row} == set(reached), (trial, row)
            tested = set() if greedy[row] else {at for at in reached if at < lens[row]}
            assert {at for r, at in asked["draft"] if r == row} == tested, (trial, row)


def test_verify_consumes_the_rows_own_proposal_length_plus_one_uniforms() -> None:
    """Per sampling row k_b + 1 uniforms, whatever the other rows proposed (the batch's window K)."""
    k, vocab = 3, 8
    target, tokens, lens, draft, _ = _random_verify_inputs(4, k, vocab, seed=9)
    lens = torch.tensor([0, 2, 1, 3])
    greedy = torch.tensor([False, True, False, False])
    gens = [sequence_generator(3, i, "target") for i in range(4)]
    twins = [sequence_generator(3, i, "target") for i in range(4)]
    verify_proposals(target, tokens, lens, draft, greedy, gens)
    for i in (0, 2, 3):
        torch.rand(int(lens[i]) + 1, generator=twins[i], dtype=torch.float64)
    assert all(torch.equal(g.get_state(), t.get_state()) for g, t in zip(gens, twins, strict=True))


# --------------------------------------------------------------------------------------------------------
# Distribution exactness of the full speculative loop
# --------------------------------------------------------------------------------------------------------

VOCAB = 16
CONTEXT = 3
N_SAMPLES = 5000
N_TOKENS = 3
K = 3


def _tables(sharp_target: float, sharp_draft: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logits given the previous token, for a target and a different draft model."""
    target = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(11)) * sharp_target
    noise = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(12)) * sharp_draft
    return target, 0.5 * target + noise


def _speculate(params: SamplingParams, *, broken_q: bool = False, seed: int = 0) -> np.ndarray:
    """Run the speculative loop for N_SAMPLES samples in one batch; return their first N_TOKENS tokens.

    Every iteration the draft proposes k_b in {0..K} tokens (random per row and iteration, independent of
    the sampling) by sampling from ``draft_distribution`` of its processed distribution -- what the real
    draft does -- and the target verifies with ``verify_proposals``. Padded draft positions hold garbage.
    ``broken_q`` hands the target its own distribution as q (always accept: the draft's tokens go through
    unchecked).
    """
    target_tab, draft_tab = _tables(2.0, 2.0)
    p_tab = process_logits(target_tab, [params] * VOCAB)  # [prev, V]
    q_tab = torch.stack(
        [draft_distribution(row, params.greedy)[0] for row in process_logits(draft_tab, [params] * VOCAB)]
    )
    draft_gens = [sequence_generator(seed, i, "draft") for i in range(N_SAMPLES)]
    target_gens = [sequence_generator(seed, i, "target") for i in range(N_SAMPLES)]
    rng = torch.Generator().manual_seed(seed + 1)
    greedy = torch.full((N_SAMPLES,), params.greedy)
    last = torch.full((N_SAMPLES,), CONTEXT, dtype=torch.long)
    out = torch.full((N_SAMPLES, N_TOKENS * (K + 1)), -1, dtype=torch.long)
    n_out = torch.zeros(N_SAMPLES, dtype=torch.long)
    rows = torch.arange(N_SAMPLES)
    for _ in range(N_TOKENS):  # every iteration emits >= 1 token
        lens = torch.randint(0, K + 1, (N_SAMPLES,), generator=rng)
        tokens = torch.empty(N_SAMPLES, K, dtype=torch.long)
        q = torch.empty(N_SAMPLES, K, VOCAB)
        prev = last
        for i in range(K):
            q[:, i] = q_tab[prev]
            tokens[:, i] = sample(q[:, i], draft_gens)
            prev = tokens[:, i]
        contexts = torch.cat([last.unsqueeze(1), tokens], dim=1)  # position i predicts draft token i
        p = p_tab[contexts]
        pad = torch.arange(K).unsqueeze(0) >= lens.unsqueeze(1)
        tokens = torch.where(pad, torch.randint(0, VOCAB, tokens.shape, generator=rng), tokens)
        q = torch.where(pad.unsqueeze(-1), torch.rand(q.shape, generator=rng), q)
        accepted, nxt = verify_proposals(p, tokens, lens, p[:, :K] if broken_q else q, greedy, target_gens)
        assert (accepted <= lens).all()
        for j in range(K + 1):
            emit = j < accepted + 1
            value = torch.where(j < accepted, tokens[:, min(j, K - 1)], nxt)
            out[rows[emit], n_out[emit] + j] = value[emit]
        n_out += accepted + 1
        last = out[rows, n_out - 1]
    assert (n_out >= N_TOKENS).all()
    return out[:, :N_TOKENS].numpy()


def _exact(params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Exact P(t1, t2) [V, V] and P(t3) [V] of the target by the chain rule."""
    target_tab, _ = _tables(2.0, 2.0)
    p_tab = process_logits(target_tab, [params] * VOCAB).double().numpy()
    p_tab /= p_tab.sum(-1, keepdims=True)
    joint12 = p_tab[CONTEXT][:, None] * p_tab
    marg3 = joint12.sum(0) @ p_tab
    return joint12, marg3


def _chi_square_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; cells with expected count < 5 are merged (smallest first)."""
    observed = observed.ravel().astype(np.float64)
    expected = probs.ravel() / probs.sum() * observed.sum()
    impossible = expected == 0
    assert observed[impossible].sum() == 0, "a token with zero target probability was emitted"
    observed, expected = observed[~impossible], expected[~impossible]
    order = np.argsort(expected, kind="stable")
    observed, expected = observed[order], expected[order]
    cut = 0
    while cut < expected.size and expected[:cut].sum() < 5:
        cut += 1
    if cut > 1:
        observed = np.concatenate([[observed[:cut].sum()], observed[cut:]])
        expected = np.concatenate([[expected[:cut].sum()], expected[cut:]])
    if observed.size < 2:
        return 1.0
    return float(stats.chisquare(observed, expected).pvalue)


def _pvalues(params: SamplingParams, samples: np.ndarray) -> tuple[float, float]:
    joint12, marg3 = _exact(params)
    pairs = np.bincount(samples[:, 0] * VOCAB + samples[:, 1], minlength=VOCAB * VOCAB)
    third = np.bincount(samples[:, 2], minlength=VOCAB)
    return _chi_square_pvalue(pairs, joint12), _chi_square_pvalue(third, marg3)


EXACTNESS_CASES = {
    "temperature_0.8": SamplingParams(temperature=0.8),
    "temperature_1.3": SamplingParams(temperature=1.3),
    "top_k_5": SamplingParams(temperature=1.0, top_k=5),
    "top_p_0.8": SamplingParams(temperature=1.0, top_p=0.8),
    "combined": SamplingParams(temperature=0.9, top_k=8, top_p=0.9),
}


@pytest.mark.parametrize("name", list(EXACTNESS_CASES))
def test_speculative_sampling_is_exact(name: str) -> None:
    params = EXACTNESS_CASES[name]
    p_pairs, p_third = _pvalues(params, _speculate(params))
    assert p_pairs > ALPHA and p_third > ALPHA, (p_pairs, p_third)


def test_draft_alone_differs_from_target() -> None:
    """Sanity for the teeth: the draft's own distribution is far from the target's."""
    params = EXACTNESS_CASES["temperature_1.3"]
    target_tab, draft_tab = _tables(2.0, 2.0)
    p = process_logits(target_tab, [params] * VOCAB)
    q = process_logits(draft_tab, [params] * VOCAB)
    assert 0.5 * (p - q).abs().sum(-1).mean().item() > 0.3  # mean total-variation distance


def test_exactness_check_rejects_always_accept() -> None:
    params = EXACTNESS_CASES["temperature_1.3"]
    p_pairs, p_third = _pvalues(params, _speculate(params, broken_q=True))
    assert min(p_pairs, p_third) < ALPHA, (p_pairs, p_third)


def test_exactness_check_rejects_correction_from_p(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a rejection, sampling from p instead of the residual max(0, p - q) biases the output."""
    monkeypatch.setattr(sampling, "_residual", lambda p, q: p)
    params = EXACTNESS_CASES["top_k_5"]
    p_pairs, p_third = _pvalues(params, _speculate(params))
    assert min(p_pairs, p_third) < ALPHA, (p_pairs, p_third)


def test_greedy_speculative_loop_is_target_argmax_chain() -> None:
    params = SamplingParams()
    samples = _speculate(params)
    target_tab, _ = _tables(2.0, 2.0)
    chain, prev = [], CONTEXT
    for _ in range(N_TOKENS):
        prev = int(target_tab[prev].argmax())
        chain.append(prev)
    assert (samples == np.array(chain)).all()
