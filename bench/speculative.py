"""The generation loops the end-to-end benchmark times: specserve's engine in-process (batched decoding
and BASS) and Hugging Face transformers (generate with n return sequences, assisted generation).

Every function generates exactly ``max_new_tokens`` tokens per sample (EOS does not stop a sequence) and
returns the tokens of every sample, so outputs of different systems can be compared token for token.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from coordinator.draft_length import DraftLength
from coordinator.speculation_gate import request_progress
from engine.batch import GroupInput
from engine.checkpoint import Checkpoint
from engine.draft import DraftRuntime
from engine.sampling import SamplingParams
from engine.target import TargetRuntime


@dataclass
class RunStats:
    """Counters of one generation call: speculative rounds and where the time went."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    target_s: float = 0.0
    total_s: float = 0.0
    draft_lens: list[int] = field(default_factory=list)

    def add(self, other: RunStats) -> None:
        """Accumulate another call's counters into this one."""
        self.rounds += other.rounds
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.draft_s += other.draft_s
        self.target_s += other.target_s
        self.total_s += other.total_s
        self.draft_lens += other.draft_lens


def _group(prompt: list[int], n: int, params: SamplingParams, max_new_tokens: int) -> GroupInput:
    return GroupInput(group_id=0, prompt_token_ids=list(prompt), sequence_ids=list(range(n)), params=params,
                      max_new_tokens=max_new_tokens)


def engine_batched(target: TargetRuntime, prompt: list[int], n: int, params: SamplingParams,
                   max_new_tokens: int) -> tuple[list[list[int]], RunStats]:
    """System (a): plain batched decoding on the target runtime, one token per sequence per step.

    Prefill samples each sequence's first token; every further step is a ``verify`` with empty proposals.
    Returns n samples of exactly ``max_new_tokens`` tokens and the step count (as ``rounds``).
    """
    stats = RunStats()
    start = time.perf_counter()
    batch_id = f"bench-a-{uuid.uuid4().hex}"
    first = target.prefill(batch_id, [_group(prompt, n, params, max_new_tokens)]).first_tokens
    out = {sid: [first[sid]] for sid in range(n)}
    try:
        while len(out[0]) < max_new_tokens:
            for verdict in target.verify(batch_id, {sid: ([], []) for sid in range(n)}):
                out[verdict.sequence_id].append(verdict.next_token_id)
            stats.rounds += 1
    finally:
        target.release(batch_id)
    stats.total_s = stats.target_s = time.perf_counter() - start
    return [out[sid] for sid in range(n)], stats


def engine_bass(target: TargetRuntime, draft: DraftRuntime, prompt: list[int], n: int, params: SamplingParams,
                max_new_tokens: int, length: DraftLength) -> tuple[list[list[int]], RunStats]:
    """System (d): batched speculative decoding in-process, the coordinator's round loop without gRPC.

    Each round the draft proposes ``length.for_round()`` tokens per live sequence (0 in a plain round) and the
    target verifies them all in one pass; ``length`` is updated from the round's accepted lengths and time.
    Sequences leave the batch once they have ``max_new_tokens`` tokens (surplus accepted tokens are dropped,
    as the coordinator does). Greedy output equals the target's greedy decoding.
    """
    stats = RunStats()
    start = time.perf_counter()
    batch_id = f"bench-d-{uuid.uuid4().hex}"
    group = _group(prompt, n, params, max_new_tokens)
    first = target.prefill(batch_id, [group]).first_tokens
    draft.prefill(batch_id, [group])
    prefilled = time.perf_counter()
    stats.target_s = prefilled - start  # both prefills; the draft's is a small share
    out = {sid: [first[sid]] for sid in range(n)}
    updates: dict[int, tuple[int, int, list[int]]] = {sid: (0, first[sid], []) for sid in range(n)}
    live = [sid for sid in range(n) if len(out[sid]) < max_new_tokens]
    finished: list[int] = []
    sampled = not params.greedy
    try:
        while live:
            _, k = length.for_round(sampled=sampled, sequences=len(live))  # 0: a plain round (the gate chose it)
            t0 = time.perf_counter()
            proposals = draft.propose(batch_id, {sid: updates[sid] for sid in live}, k, release=finished)
            t1 = time.perf_counter()
            verdicts = target.verify(batch_id, {p.sequence_id: (p.token_ids, p.distributions) for p in proposals},
                                     release=finished)
            t2 = time.perf_counter()
            stats.draft_s += t1 - t0
            stats.target_s += t2 - t1
            stats.rounds += 1
            stats.draft_lens.append(k)
            proposed = {p.sequence_id: p.token_ids for p in proposals}
            finished = []
            accepted, lengths, before, after = [], [], [], []
            for verdict in verdicts:
                sid = verdict.sequence_id
                tokens = proposed[sid][: verdict.accepted_len] + [verdict.next_token_id]
                seq = out[sid]
                before.append(len(seq))
                seq.extend(tokens[: max_new_tokens - len(seq)])
                after.append(len(seq))
                updates[sid] = (verdict.accepted_len, verdict.next_token_id, [])
                accepted.append(verdict.accepted_len)
                lengths.append(len(proposed[sid]))
                stats.proposed += len(proposed[sid])
                stats.accepted += verdict.accepted_len
                if len(seq) >= max_new_tokens:
                    finished.append(sid)
            live = [sid for sid in live if sid not in set(finished)]
            progress = request_progress(before, after, [size >= max_new_tokens for size in after])
            length.update(k, accepted, t2 - t0, lengths, sampled, progress=progress)
    finally:
        target.release(batch_id)
        draft.release(batch_id)
    stats.total_s = time.perf_counter() - start
    return [out[sid] for sid in range(n)], stats


def _hf_kwargs(model: PreTrainedModel, temperature: float, max_new_tokens: int) -> dict[str, object]:
    """generate() kwargs: exactly max_new_tokens (no EOS stop), greedy or plain temperature sampling."""
    kwargs: dict[str, object] = dict(max_new_tokens=max_new_tokens, eos_token_id=None,
                                     pad_token_id=model.config.pad_token_id or 0)
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False)
    return kwargs


def hf_generate(model: PreTrainedModel, prompt: list[int], n: int, temperature: float, max_new_tokens: int,
                seed: int) -> tuple[list[list[int]], RunStats]:
    """System (b): ``model.generate`` for n samples in one batch.

    Greedy: the prompt repeated n times (``num_return_sequences > 1`` needs sampling); sampling:
    ``num_return_sequences=n``. Returns n samples of exactly ``max_new_tokens`` tokens.
    """
    start = time.perf_counter()
    kwargs = _hf_kwargs(model, temperature, max_new_tokens)
    rows = 1 if temperature > 0 else n
    if temperature > 0:
        kwargs["num_return_sequences"] = n
        torch.manual_seed(seed)
    ids = torch.tensor([list(prompt)] * rows)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    samples = out[:, len(prompt):].tolist()
    return samples, RunStats(total_s=time.perf_counter() - start, target_s=time.perf_counter() - start)


def hf_assistant(draft: Checkpoint) -> PreTrainedModel:
    """The draft as HF assisted generation can call it: its own model, or for a subset-vocabulary draft an
    equivalent full-vocabulary copy (every other id reads the catch-all row; the head gets a bias of -inf at
    ids outside the subset), so HF sees the same distribution specserve serves, at the cost of a full head."""
    token_map = draft.token_map
    if token_map is None:
        return draft.model
    source = draft.model
    config = source.config.__class__.from_dict({**source.config.to_dict(), "vocab_size": token_map.target_vocab_size,
                                                "tie_word_embeddings": False})
    model = type(source)(config).to(dtype=source.dtype, device=source.device).eval()
    state = {k: v for k, v in source.state_dict().items() if not k.startswith(("lm_head", "model.embed_tokens"))}
    model.load_state_dict(state, strict=False)
    head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=True, dtype=source.dtype, device=source.device)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(source.get_input_embeddings().weight[token_map.target_to_draft])
        head.weight.zero_()
        head.weight[token_map.mapped_ids] = source.get_output_embeddings().weight[token_map.mapped_rows]
        head.bias.fill_(float("-inf"))
        head.bias[token_map.mapped_ids] = 0.0
    model.lm_head = head
    return model


def hf_assisted(model: PreTrainedModel, assistant: PreTrainedModel, prompt: list[int], n: int, temperature: float,
                max_new_tokens: int, seed: int) -> tuple[list[list[int]], RunStats]:
    """System (c): HF assisted generation (``assistant_model=``), batch size 1, the n samples one after
    another (HF supports assisted generation for a single sequence only). HF's own defaults for the
    number of assistant tokens apply. Returns n samples of exactly ``max_new_tokens`` tokens.
    """
    start = time.perf_counter()
    kwargs = _hf_kwargs(model, temperature, max_new_tokens)
    ids = torch.tensor([list(prompt)])
    samples = []
    for index in range(n):
        if temperature > 0:
            torch.manual_seed(seed + index)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=assistant, **kwargs)
        samples.append(out[0, len(prompt):].tolist())
    return samples, RunStats(total_s=time.perf_counter() - start, target_s=time.perf_counter() - start)
