"""Distil the default draft (models/smollm2-draft) from the default target, SmolLM2-135M-Instruct.

Recipe (documented with its results in models/README.md):

1. Data, from the *training* split of the stdlib corpus (the split of ``train_default_models.py``; the held-out
   files are never seen): natural 256-token windows of the training stream, and the target's own
   continuations (128 new tokens, half greedy, half sampled at T=0.8 / top-p 0.95) of 128-token prompts that
   end at a line break. The continuations are generated once (bf16 copy of the target) and cached.
2. Student: with ``--vocab-subset N`` (the shipped draft) the target's first ``--target-layers`` layers and final
   norm, with a tied embedding/head over the N token ids most frequent in the training files plus a catch-all
   row (``engine/token_map.py``; the KL folds the target's mass outside the subset into that row); otherwise a
   small Llama over the whole vocabulary whose embedding is the target's projected on its top principal
   components.
3. Training: online distillation (the target runs in bf16 beside the student): ``KL(target || draft)`` at
   temperature 1 on every position, over the target's top ``--topk`` tokens plus one bucket for the rest of
   the vocabulary, plus ``--ce-weight`` x cross-entropy on the actual next token; AdamW, cosine schedule over
   a wall-clock budget. ``--init`` continues from an earlier checkpoint (a second stage).
4. Saved in bf16 (the runtime loads it in fp32), with the target's tokenizer, so it loads on its own.
5. Evaluated on held-out prompts against the fp32 target: greedy acceptance at k=4 (the simulation of
   ``train_default_models.acceptance``, and through specserve's runtimes with the draft model alone and with
   prompt lookup), the expected sampled acceptance sum_x min(p(x), q(x)) at T=0.8, and the calibration of the
   draft's top probability (what the draft service's confidence floor relies on).

    # the shipped draft, two stages (see models/README.md; each stage makes its own continuation cache)
    rm -f /tmp/specserve-distill-data.pt
    .venv/bin/python tools/distill_draft.py --out /tmp/draft-stage1 --gen-minutes 5 --train-minutes 42 \
        --vocab-subset 7168 --target-layers 1 --lr 2e-3 --warmup 20
    rm -f /tmp/specserve-distill-data.pt
    .venv/bin/python tools/distill_draft.py --out models/smollm2-draft --init /tmp/draft-stage1 --gen-minutes 8 \
        --train-minutes 55 --lr 1e-3 --warmup 20
    .venv/bin/python tools/distill_draft.py --out models/smollm2-draft --eval-only
    .venv/bin/python tools/distill_draft.py --out models/smollm2-draft --eval-only calibration
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train_default_models as corpus_rules  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

from bench.speculative import RunStats, engine_bass  # noqa: E402
from coordinator.draft_length import DraftLength  # noqa: E402
from engine.checkpoint import load_checkpoint  # noqa: E402
from engine.default_models import default_target  # noqa: E402
from engine.draft import DraftRuntime  # noqa: E402
from engine.prompt_lookup import DEFAULT_NGRAM_SIZES, LookupScore, PromptLookup, PromptNgrams  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.target import TargetRuntime  # noqa: E402
from engine.token_map import CATCH_ALL, TokenMap, load_token_map  # noqa: E402

# the tiny pair's corpus helpers, shared: progress lines, token ids without special tokens, LR schedule
log, encode, lr_at = corpus_rules.log, corpus_rules.encode, corpus_rules.lr_at

PROMPT_TOKENS = 128
NEW_TOKENS = 128
WINDOW = PROMPT_TOKENS + NEW_TOKENS


def training_stream(tokenizer, train: list[tuple[str, str]], eos: int) -> torch.Tensor:
    """Corpus files tokenized and joined by EOS, as one int32 tensor."""
    ids: list[int] = []
    for _, text in train:
        ids.extend(encode(tokenizer, text))
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def line_prompts(stream: torch.Tensor, newline_ids: set[int], count: int, rng: random.Random) -> list[list[int]]:
    """``count`` prompts of exactly PROMPT_TOKENS tokens of the stream, each ending with a newline token."""
    ends = [i for i in range(PROMPT_TOKENS, len(stream)) if int(stream[i - 1]) in newline_ids]
    picks = rng.sample(ends, min(count, len(ends)))
    return [stream[e - PROMPT_TOKENS:e].tolist() for e in picks]


@torch.inference_mode()
def generate_continuations(teacher, prompts: list[list[int]], batch: int, seed: int, deadline: float
                           ) -> list[list[int]]:
    """prompt + NEW_TOKENS target tokens for as many prompts as fit before ``deadline`` (alternating
    greedy and sampled batches)."""
    out: list[list[int]] = []
    for index, start in enumerate(range(0, len(prompts), batch)):
        if time.time() > deadline:
            break
        x = torch.tensor(prompts[start:start + batch])
        sample = index % 2 == 1
        torch.manual_seed(seed + index)
        generated = teacher.generate(
            input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
            do_sample=sample, temperature=0.8 if sample else None, top_p=0.95 if sample else None, top_k=None,
            pad_token_id=teacher.config.pad_token_id)
        out.extend(generated.tolist())
        log(f"  generated {len(out)} sequences ({'sampled' if sample else 'greedy'} batch {index})")
    return out


def student_config(target_config, hidden: int, layers: int, heads: int, kv_heads: int, mlp: int) -> LlamaConfig:
    """The draft's config: target's vocabulary, special ids, context and RoPE base; a small body."""
    return LlamaConfig(
        vocab_size=target_config.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=mlp,
        max_position_embeddings=target_config.max_position_embeddings,
        rope_parameters=dict(target_config.rope_parameters), rms_norm_eps=target_config.rms_norm_eps,
        tie_word_embeddings=True, bos_token_id=target_config.bos_token_id, eos_token_id=target_config.eos_token_id,
        pad_token_id=target_config.pad_token_id, architectures=["LlamaForCausalLM"])


def make_student(target, config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    """A fresh student whose embedding is the target's projected on its top principal directions."""
    torch.manual_seed(seed)
    student = LlamaForCausalLM(config)
    emb = target.get_input_embeddings().weight.detach().float()
    _, _, v = torch.linalg.svd(emb - emb.mean(0), full_matrices=False)
    projected = emb @ v[: config.hidden_size].T
    projected *= student.get_input_embeddings().weight.std() / projected.std()
    student.get_input_embeddings().weight.data.copy_(projected)
    return student


def frequent_subset(stream: torch.Tensor, vocab_size: int, size: int, keep: set[int]) -> torch.Tensor:
    """The ``size`` most frequent token ids of the training stream (ties by id), always including ``keep``
    (the special ids), in ascending id order."""
    counts = torch.bincount(stream.long(), minlength=vocab_size).double()
    counts[sorted(keep)] = float("inf")
    order = torch.argsort(-counts, stable=True)
    return order[:size].sort().values


def make_layer_student(target, subset: torch.Tensor, layers: int) -> tuple[LlamaForCausalLM, TokenMap]:
    """A student with the target's width whose body is a copy of the target's first ``layers`` layers and its
    final norm, and whose tied embedding/head is the target's embedding rows for ``subset`` plus one catch-all
    row (initialised to the mean embedding); returned with the token map that serves it."""
    tc = target.config
    config = student_config(tc, tc.hidden_size, layers, tc.num_attention_heads, tc.num_key_value_heads,
                            tc.intermediate_size)
    config.vocab_size = len(subset) + 1
    config.head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    student = LlamaForCausalLM(config)
    for mine, theirs in zip(student.model.layers, target.model.layers[:layers], strict=False):
        mine.load_state_dict(theirs.state_dict())
    student.model.norm.load_state_dict(target.model.norm.state_dict())
    emb = target.get_input_embeddings().weight.detach().float()
    student.get_input_embeddings().weight.data.copy_(torch.cat([emb[subset], emb.mean(0, keepdim=True)]))
    table = torch.cat([subset, torch.tensor([CATCH_ALL])])
    return student, TokenMap(table, tc.vocab_size)


def subset_kd_losses(logits: torch.Tensor, teacher_logits: torch.Tensor, nxt: torch.Tensor, token_map: TokenMap
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(teacher || student) with the teacher's mass outside the draft's subset folded into the catch-all row,
    cross-entropy on the next token's draft row), both averaged over all positions but the last."""
    log_norm = torch.logsumexp(teacher_logits.float(), -1, keepdim=True)
    p = (teacher_logits[..., token_map.mapped_ids].float() - log_norm).exp()
    rest = (1 - p.sum(-1, keepdim=True)).clamp(min=1e-6)
    p = torch.cat([p, rest], -1)  # rows in the order of mapped_rows, then the catch-all
    log_q = torch.log_softmax(logits.float(), -1)
    log_q = torch.cat([log_q[..., token_map.mapped_rows], log_q[..., token_map.catch_all_row, None]], -1)
    kl = (p * (p.clamp(min=1e-12).log() - log_q)).sum(-1)
    ce = -torch.log_softmax(logits.float(), -1).gather(-1, token_map.to_draft(nxt)[..., None])[..., 0]
    return kl[:, :-1].mean(), ce[:, :-1].mean()


def teacher_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's k most probable tokens per position: (probabilities [B, T, k], ids [B, T, k])."""
    values, ids = logits.topk(k, dim=-1)
    log_norm = torch.logsumexp(logits.float(), -1, keepdim=True)
    return (values.float() - log_norm).exp(), ids


def sparse_kd_losses(logits: torch.Tensor, teacher_top: tuple[torch.Tensor, torch.Tensor], nxt: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(teacher || student) over the teacher's top-k tokens plus one bucket for the rest of the vocabulary,
    cross-entropy on the next token), both averaged over all positions but the last."""
    probs, ids = teacher_top
    log_norm = torch.logsumexp(logits.float(), -1, keepdim=True)
    student_top = logits.gather(-1, ids).float() - log_norm
    rest_p = (1 - probs.sum(-1)).clamp(min=1e-6)
    rest_q = torch.log1p(-student_top.exp().sum(-1).clamp(max=1 - 1e-6))
    kl = (probs * (probs.clamp(min=1e-12).log() - student_top)).sum(-1) + rest_p * (rest_p.log() - rest_q)
    ce = log_norm[..., 0] - logits.gather(-1, nxt[..., None])[..., 0].float()
    return kl[:, :-1].mean(), ce[:, :-1].mean()


def train(student, teacher, generated: torch.Tensor, stream: torch.Tensor, args: argparse.Namespace,
          token_map: TokenMap | None) -> dict:
    """Online distillation for ``args.train_minutes`` of wall time; returns the training record."""
    rng = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(student.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    student.train()
    started, step, total, ema = time.time(), 0, 10**9, None
    budget = args.train_minutes * 60
    half = args.batch // 2
    while step < total:
        rows = generated[torch.randint(len(generated), (half,), generator=rng)]
        starts = torch.randint(len(stream) - WINDOW - 1, (args.batch - half,), generator=rng)
        windows = torch.stack([stream[s:s + WINDOW + 1].long() for s in starts.tolist()])
        x = torch.cat([rows[:, :WINDOW], windows[:, :WINDOW]])
        nxt = torch.cat([torch.cat([rows[:, 1:WINDOW], rows[:, WINDOW - 1:WINDOW]], 1), windows[:, 1:]])
        with torch.no_grad():
            teacher_logits = teacher(input_ids=x).logits
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, args.lr, args.warmup)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = student(input_ids=x if token_map is None else token_map.to_draft(x)).logits
        if token_map is None:
            kl, ce = sparse_kd_losses(logits, teacher_topk(teacher_logits, args.topk), nxt)
        else:
            kl, ce = subset_kd_losses(logits, teacher_logits, nxt, token_map)
        loss = kl + args.ce_weight * ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        step += 1
        ema = kl.item() if ema is None else 0.95 * ema + 0.05 * kl.item()
        if step == 5:
            per_step = (time.time() - started) / 5
            total = max(args.warmup + 10, int(budget / per_step))
            log(f"  {per_step:.2f} s/step -> {total} steps in {args.train_minutes} min")
        if step % 25 == 0:
            log(f"  step {step}/{total} kl(ema) {ema:.4f} ce {ce.item():.4f} lr {opt.param_groups[0]['lr']:.2e}")
    student.eval()
    return {"steps": step, "tokens_seen": step * args.batch * WINDOW, "batch": args.batch, "window": WINDOW,
            "peak_lr": args.lr, "ce_weight": args.ce_weight, "final_kl_ema": round(ema, 4),
            "wall_minutes": round((time.time() - started) / 60, 2)}


def draft_logits(draft, token_map: TokenMap | None, ids: torch.Tensor) -> torch.Tensor:
    """The draft's logits over the target's vocabulary for target token ids [B, T]."""
    if token_map is None:
        return draft(input_ids=ids).logits
    return token_map.to_target_logits(draft(input_ids=token_map.to_draft(ids)).logits)


def mapped_greedy(draft, token_map: TokenMap):
    """A greedy continuation function (ids, n_new) -> target ids for a subset-vocabulary draft."""
    @torch.inference_mode()
    def run(ids: list[int], n_new: int) -> list[int]:
        out = draft(input_ids=token_map.to_draft(torch.tensor([ids])), use_cache=True)
        tokens: list[int] = []
        while True:
            token = int(token_map.to_target_logits(out.logits[0, -1]).argmax())
            tokens.append(token)
            if len(tokens) == n_new:
                return tokens
            out = draft(input_ids=token_map.to_draft(torch.tensor([[token]])), past_key_values=out.past_key_values,
                        use_cache=True)
    return run


@torch.inference_mode()
def sampled_overlap(target, draft, prompts: list[dict], temperature: float, new_tokens: int, seed: int,
                    token_map: TokenMap | None = None) -> dict:
    """Mean over sampled target continuations of sum_x min(p(x), q(x)) at ``temperature``: the probability
    that lossless speculative sampling accepts a draft token at each position."""
    torch.manual_seed(seed)
    total, count = 0.0, 0
    for p in prompts:
        x = torch.tensor([p["ids"]])
        out = target.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=True, temperature=temperature, top_p=None,
                              top_k=None, pad_token_id=target.config.pad_token_id)
        start = len(p["ids"]) - 1
        pt = F.softmax(target(input_ids=out).logits[0, start:-1].float() / temperature, -1)
        qd = F.softmax(draft_logits(draft, token_map, out)[0, start:-1].float() / temperature, -1)
        total += torch.minimum(pt, qd).sum(-1).sum().item()
        count += pt.shape[0]
    return {"temperature": temperature, "positions": count, "expected_acceptance": round(total / count, 4)}


def engine_acceptance(draft_dir: Path, prompts: list[dict], k: int, new_tokens: int) -> dict:
    """Greedy acceptance at fixed k through specserve's own runtimes (fp32, one sample per prompt, the first
    token from the target's prefill), the draft model alone and with its default prompt lookup."""
    target = TargetRuntime(load_checkpoint(default_target()))
    checkpoint = load_checkpoint(draft_dir)
    result = {}
    for name, lookup in (("model_alone", None), ("prompt_lookup", DEFAULT_NGRAM_SIZES)):
        draft = DraftRuntime(checkpoint, prompt_lookup=lookup, confidence_floor=0.0)  # every proposal k long
        total = RunStats()
        for p in prompts:
            _, stats = engine_bass(target, draft, p["ids"], 1, SamplingParams(), new_tokens,
                                   DraftLength(k, k, adaptive=False))
            total.add(stats)
        result[name] = {"accepted": total.accepted, "proposed": total.proposed, "rounds": total.rounds,
                        "acceptance_rate": round(total.accepted / max(1, total.proposed), 4),
                        "tokens_per_round": round(len(prompts) * (new_tokens - 1) / max(1, total.rounds), 3)}
        log(f"  engine greedy acceptance at k={k}, {name}: {result[name]['acceptance_rate']}")
    return {"k": k, "new_tokens_per_prompt": new_tokens, "prompts": len(prompts), "lookup_ngram_sizes":
            list(DEFAULT_NGRAM_SIZES), **result}


CONFIDENCE_BINS = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


@torch.inference_mode()
def confidence_calibration(target, draft, token_map: TokenMap | None, prompts: list[dict], new_tokens: int) -> dict:
    """How well the draft's top probability predicts that its greedy token is the target's, along the target's
    greedy continuation of each prompt (the context an accepted proposal has), binned by that probability;
    and how often prompt lookup (``engine.prompt_lookup``, default n-grams) finds a continuation there and
    its first token is the target's. This is what the draft's confidence floor relies on."""
    confidences, matches, lookup_found, lookup_right = [], [], 0, 0
    for p in prompts:
        x = torch.tensor([p["ids"]])
        out = target.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=target.config.pad_token_id)
        start = len(p["ids"])
        probs = F.softmax(draft_logits(draft, token_map, out)[0, start - 1:-1].float(), dim=-1)
        top, guess = probs.max(dim=-1)
        truth = out[0, start:]
        confidences += top.tolist()
        matches += (guess == truth).tolist()
        lookup = PromptLookup(PromptNgrams(p["ids"], *DEFAULT_NGRAM_SIZES), LookupScore())
        for token in truth.tolist():
            found = lookup.propose(1)
            lookup_found += bool(found)
            lookup_right += found == [token]
            lookup.extend([token])
    bins = []
    for lo, hi in zip(CONFIDENCE_BINS, CONFIDENCE_BINS[1:], strict=False):
        inside = [m for c, m in zip(confidences, matches, strict=True) if lo <= c < hi or (hi == 1.0 and c == 1.0)]
        bins.append({"confidence": [lo, hi], "share": round(len(inside) / len(matches), 4),
                     "match_rate": round(sum(inside) / len(inside), 4) if inside else None})
    return {"positions": len(matches), "match_rate": round(sum(matches) / len(matches), 4), "bins": bins,
            "lookup_found_share": round(lookup_found / len(matches), 4),
            "lookup_right_when_found": round(lookup_right / max(1, lookup_found), 4)}


def evaluate(target, draft, token_map: TokenMap | None, tokenizer, held: list[tuple[str, str]],
             args: argparse.Namespace) -> dict:
    """Held-out greedy acceptance at k (simulated with HF, and through specserve's runtimes without and with
    prompt lookup) and sampled acceptance at T=0.8, against the fp32 target."""
    prompts = corpus_rules.make_prompts(tokenizer, held, args.eval_prompts)
    log(f"evaluating on {len(prompts)} held-out prompts")
    draft_greedy = None if token_map is None else mapped_greedy(draft, token_map)
    greedy = corpus_rules.acceptance(target, draft, prompts, k=args.k, n_new=64, draft_greedy=draft_greedy)
    log(f"  greedy acceptance at k={args.k}: {greedy['acceptance_rate']}")
    engine = engine_acceptance(Path(args.out), prompts, args.k, 64)
    sampled = sampled_overlap(target, draft, prompts[: args.eval_sampled], 0.8, 64, args.seed, token_map)
    log(f"  expected sampled acceptance at T=0.8: {sampled['expected_acceptance']}")
    calibration = confidence_calibration(target, draft, token_map, prompts, 64)
    log(f"  draft top-1 matches the target at {calibration['match_rate']} of positions; calibration by bin: "
        + ", ".join(f"{b['confidence'][0]:.1f}: {b['match_rate']}" for b in calibration["bins"]))
    result = {"greedy": greedy, "engine_greedy": engine, "sampled": sampled, "calibration": calibration}
    if token_map is not None:
        held_ids = training_stream(tokenizer, held, int(target.config.eos_token_id))
        inside = token_map.to_draft(held_ids.long()) != token_map.catch_all_row
        result["heldout_tokens_in_subset"] = round(inside.double().mean().item(), 4)
        log(f"  held-out tokens inside the draft's subset: {result['heldout_tokens_in_subset']}")
    return result


def main(argv: list[str] | None = None) -> int:
    """Generate data, distil, save and evaluate the draft (or only evaluate with --eval-only)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models/smollm2-draft")
    ap.add_argument("--data-cache", default="/tmp/specserve-distill-data.pt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gen-minutes", type=float, default=10.0)
    ap.add_argument("--gen-batch", type=int, default=48)
    ap.add_argument("--train-minutes", type=float, default=20.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--ce-weight", type=float, default=0.2)
    ap.add_argument("--topk", type=int, default=64, help="teacher tokens per position in the KD loss (+ a rest bucket)")
    ap.add_argument("--init", default=None, help="continue training this draft checkpoint")
    ap.add_argument("--vocab-subset", type=int, default=0,
                    help="a draft over the N most frequent training tokens + a catch-all row, its body the target's "
                         "first --target-layers layers (0: a full-vocabulary draft of --hidden/--layers/...)")
    ap.add_argument("--target-layers", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--mlp", type=int, default=512)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--eval-prompts", type=int, default=30)
    ap.add_argument("--eval-sampled", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-only", nargs="?", const="all", choices=["all", "calibration"],
                    help="evaluate the saved draft without training (calibration: only the confidence calibration, "
                         "merged into metrics.json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    target_dir = default_target()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    train_files, held = corpus_rules.collect_corpus(Path(sysconfig.get_paths()["stdlib"]))
    metrics_path = out / "metrics.json"
    if not args.eval_only:
        teacher = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
        stream = training_stream(tokenizer, train_files, int(target.config.eos_token_id))
        log(f"training stream: {len(train_files)} files, {len(stream)} tokens; held-out files: {len(held)}")
        cache = Path(args.data_cache)
        if cache.is_file():
            generated = torch.load(cache)
        else:
            newline_ids = {i for t, i in tokenizer.get_vocab().items() if t.endswith("Ċ")}
            prompts = line_prompts(stream, newline_ids, 4000, random.Random(args.seed))
            deadline = time.time() + args.gen_minutes * 60
            generated = torch.tensor(generate_continuations(teacher, prompts, args.gen_batch, args.seed, deadline))
            torch.save(generated, cache)
        log(f"target continuations: {len(generated)} sequences of {generated.shape[1]} tokens")
        torch.manual_seed(args.seed)
        if args.init:
            student = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32)
            token_map = load_token_map(args.init, student.config.vocab_size)
        elif args.vocab_subset:
            specials = {int(t) for t in (target.config.bos_token_id, target.config.eos_token_id,
                                         target.config.pad_token_id) if t is not None}
            subset = frequent_subset(stream, target.config.vocab_size, args.vocab_subset, specials)
            student, token_map = make_layer_student(target, subset, args.target_layers)
        else:
            student = make_student(target, student_config(target.config, args.hidden, args.layers, args.heads,
                                                          args.kv_heads, args.mlp), args.seed)
            token_map = None
        record = train(student, teacher, generated, stream, args, token_map)
        del teacher
        student.to(torch.bfloat16).save_pretrained(out)
        student.generation_config.save_pretrained(out)
        tokenizer.save_pretrained(out)
        if token_map is not None:
            token_map.save(out)
        init_metrics = Path(args.init or "") / "metrics.json"
        previous = json.loads(init_metrics.read_text())["training"] if args.init and init_metrics.is_file() else None
        metrics = {"training": {**record, "init": args.init, "previous_stage": previous,
                                "generated_sequences": len(generated), "new_tokens": NEW_TOKENS,
                                "prompt_tokens": PROMPT_TOKENS, "train_files": len(train_files),
                                "train_stream_tokens": len(stream)}}
    else:
        metrics = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
    draft = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    token_map = load_token_map(out, draft.config.vocab_size)
    metrics["params"] = sum(p.numel() for p in draft.parameters())
    metrics["vocab_subset"] = None if token_map is None else len(token_map.mapped_ids)
    if args.eval_only == "calibration":
        prompts = corpus_rules.make_prompts(tokenizer, held, args.eval_prompts)
        metrics.setdefault("eval", {})["calibration"] = confidence_calibration(target, draft, token_map, prompts, 64)
    else:
        metrics["eval"] = evaluate(target, draft, token_map, tokenizer, held, args)
    metrics["heldout_files"] = [rel for rel, _ in held]
    metrics_path.write_text(json.dumps(metrics, indent=2) + "\n")
    log(f"wrote {out} ({sum(f.stat().st_size for f in out.rglob('*') if f.is_file()) / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
