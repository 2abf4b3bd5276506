#!/usr/bin/env python3
"""Train the embedded default draft/target model pair (GitHub issue 3).

Everything is built offline from the Python standard library's own source code:

1. Corpus: every ``*.py`` file under ``sysconfig.get_paths()['stdlib']`` (skipping ``test``/``tests``/
   ``idlelib``/``site-packages`` directories), in sorted relative-path order.  A file is held out for
   evaluation when ``sha1(relpath) % 20 == 0`` (about 5% of the files).
2. Tokenizer: byte-level BPE (``tokenizers``), vocab 4096, special tokens ``<s> </s> <unk> <pad>``
   (ids 0..3), saved as a ``transformers.PreTrainedTokenizerFast`` into both model dirs.
3. Models: two ``LlamaForCausalLM`` trained from random init -- a target, then a draft trained on a
   mix of next-token cross-entropy and KL distillation from the (frozen) target's logits.
4. Evaluation: held-out loss/perplexity of both models and the greedy speculative acceptance rate
   at k=4 on held-out ``def`` prompts; written to ``<out>/metrics.json``.

Example (the command used for the committed checkpoints is in models/README.md)::

    python tools/train_default_models.py --out models/tiny --seed 0 \
        --minutes-target 14 --minutes-draft 8

Passing ``--steps-target``/``--steps-draft`` instead of minutes fixes the step counts (the counts a
time-budgeted run ended up with are recorded in metrics.json, so a run can be replayed exactly).
``--eval-only`` skips training and re-evaluates existing checkpoints in ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>"]
BOS, EOS, UNK, PAD = SPECIAL_TOKENS
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
HOLDOUT_MOD = 20  # sha1(relpath) % 20 == 0 -> held out (~5%)

TARGET_ARCH = dict(
    hidden_size=256,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=704,
)
DRAFT_ARCH = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=352,
)


def log(msg: str) -> None:
    """Print ``msg`` with a wall-clock time stamp, flushed at once."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------------


def is_heldout(relpath: str) -> bool:
    """Whether the stdlib file ``relpath`` is in the held-out split (a fixed hash of its path: stable across runs)."""
    return int(hashlib.sha1(relpath.encode("utf-8")).hexdigest(), 16) % HOLDOUT_MOD == 0


def collect_corpus(stdlib: Path) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Return (train, heldout) lists of (relpath, text), in sorted relpath order."""
    paths = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for fn in filenames:
            if fn.endswith(".py"):
                paths.append(Path(dirpath) / fn)
    rel = sorted((p.relative_to(stdlib).as_posix(), p) for p in paths)
    train, held = [], []
    for r, p in rel:
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue  # deterministic: the same files fail every time
        if not text.strip():
            continue
        (held if is_heldout(r) else train).append((r, text))
    return train, held


# ----------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer of ``vocab_size`` ids trained on ``texts`` (deterministic for the same texts)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # No post-processor: encode() returns the raw tokens (no BOS/EOS added).
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
        add_bos_token=False,
        add_eos_token=False,
    )
    return hf


def save_tokenizer(tok, d: Path) -> None:
    """Save as a PreTrainedTokenizerFast: tokenizer.json, tokenizer_config.json, special_tokens_map.json."""
    tok.save_pretrained(d)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    # transformers 5 writes its internal class name; the portable name loads in 4.x and 5.x alike.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    stm = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}
    (d / "special_tokens_map.json").write_text(json.dumps(stm, indent=2) + "\n")


def encode(tok, text: str) -> list[int]:
    """The token ids of ``text`` without special tokens."""
    return tok(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------


def make_config(arch: dict, tok):
    """The ``LlamaConfig`` of ``arch`` (hidden, layers, heads, ...) over the vocabulary of ``tok``."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tok),
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        initializer_range=0.02,
        use_cache=True,
        **arch,
    )


def make_model(arch: dict, tok, seed: int):
    """A freshly initialised ``LlamaForCausalLM`` of ``arch`` (seeded), generating with ``tok``'s BOS/EOS."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(make_config(arch, tok))
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.do_sample = False
    return model


def param_counts(model) -> dict:
    """Parameter counts of ``model``: total, embedding and the rest."""
    total = sum(p.numel() for p in model.parameters())
    emb = model.model.embed_tokens.weight.numel()
    return {"total": total, "embedding": emb, "non_embedding": total - emb}


def flops_per_token(cfg, ctx: int = 256) -> dict:
    """Forward multiply-accumulate FLOPs (x2) per token: non-embedding matmuls, attention, LM head."""
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hd = h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * hd
    proj = h * h * 2 + h * kv * 2  # q, o + k, v
    mlp = 3 * h * i
    attn = 2 * ctx * h  # QK^T and AV at context ctx
    non_emb = 2 * L * (proj + mlp)
    return {
        "non_embedding_matmul": non_emb,
        "attention_at_ctx": 2 * L * attn,
        "lm_head": 2 * h * cfg.vocab_size,
        "total": non_emb + 2 * L * attn + 2 * h * cfg.vocab_size,
        "ctx": ctx,
    }


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Learning rate at ``step``: linear warm-up to ``peak``, then cosine decay to ``min_ratio`` × ``peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    prog = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))


def train_model(
    name: str,
    model,
    data: torch.Tensor,
    *,
    seq_len: int,
    batch: int,
    peak_lr: float,
    warmup: int,
    steps: int | None,
    minutes: float,
    seed: int,
    bf16: bool,
    teacher=None,
    distill_alpha: float = 0.5,
    distill_temp: float = 1.0,
) -> dict:
    """Train on random windows of ``data``.

    With ``steps`` the cosine schedule runs over that many steps (exactly replayable).  Without it the
    run is wall-clock budgeted (the CPUs are shared, so step time varies): linear warmup over
    ``warmup`` steps, then cosine decay over the *time* left in ``minutes``; training stops when the
    budget is spent and the step count reached is recorded."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    model.train()
    if teacher is not None:
        teacher.eval()
    n = data.numel() - seq_len - 1
    total = steps
    budget = minutes * 60.0
    t0 = time.perf_counter()
    t_warm = None
    step = 0
    hist = []
    ema = None
    while True:
        el = time.perf_counter() - t0
        if total is not None and step >= total:
            break
        if total is None and step >= warmup and el >= budget:
            break
        if total is not None:
            lr = lr_at(step, total, peak_lr, warmup)
        elif step < warmup:
            lr = lr_at(step, 10**9, peak_lr, warmup)
        else:
            if t_warm is None:
                t_warm = el
            prog = min(1.0, (el - t_warm) / max(1e-6, budget - t_warm))
            lr = peak_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))
        starts = torch.randint(0, n, (batch,), generator=gen)
        win = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
        x, y = win[:, :-1], win[:, 1:]
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=x).logits
        logits = logits.float()
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss = ce
        kl = None
        if teacher is not None:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                tlogits = teacher(input_ids=x).logits
            tlogp = F.log_softmax(tlogits.float() / distill_temp, dim=-1)
            slogp = F.log_softmax(logits / distill_temp, dim=-1)
            kl = F.kl_div(
                slogp.reshape(-1, slogp.size(-1)), tlogp.reshape(-1, tlogp.size(-1)),
                log_target=True, reduction="batchmean",
            ) * distill_temp**2
            loss = distill_alpha * ce + (1 - distill_alpha) * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = ce.item() if ema is None else 0.95 * ema + 0.05 * ce.item()
        if step % 25 == 0 or (total is not None and step == total - 1):
            el = time.perf_counter() - t0
            extra = f" kl {kl.item():.3f}" if kl is not None else ""
            log(f"{name} step {step}/{total} lr {lr:.2e} ce {ce.item():.3f} (ema {ema:.3f}){extra}"
                f" [{el:.0f}s]")
            hist.append({"step": step, "ce": round(ce.item(), 4), "ema_ce": round(ema, 4), "t": round(el, 1)})
        step += 1
    wall = time.perf_counter() - t0
    model.eval()
    return {
        "steps": step,
        "batch": batch,
        "seq_len": seq_len,
        "tokens_seen": step * batch * seq_len,
        "peak_lr": peak_lr,
        "warmup": warmup,
        "schedule": "cosine over steps" if steps is not None else f"cosine over wall clock ({minutes} min)",
        "wall_s": round(wall, 1),
        "final_ema_train_ce": round(ema, 4) if ema is not None else None,
        "bf16_autocast": bf16,
        "distill": None if teacher is None else {"alpha_ce": distill_alpha, "temperature": distill_temp},
        "history": hist,
    }


# ----------------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------------


@torch.no_grad()
def heldout_loss(model, data: torch.Tensor, seq_len: int, max_windows: int, batch: int = 16) -> dict:
    """Mean next-token loss (and perplexity) of ``model`` on up to ``max_windows`` windows of ``data``."""
    nwin = min(max_windows, (data.numel() - 1) // seq_len)
    tot, cnt = 0.0, 0
    for b0 in range(0, nwin, batch):
        idx = range(b0, min(nwin, b0 + batch))
        win = torch.stack([data[i * seq_len : i * seq_len + seq_len + 1] for i in idx]).long()
        logits = model(input_ids=win[:, :-1]).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), win[:, 1:].reshape(-1), reduction="sum")
        tot += loss.item()
        cnt += win[:, 1:].numel()
    mean = tot / cnt
    return {"loss": round(mean, 4), "perplexity": round(math.exp(mean), 3), "tokens": cnt}


def make_prompts(tok, held: list[tuple[str, str]], n: int, min_tok: int = 64, max_tok: int = 192):
    """Deterministic ``def`` prompts from held-out files: cut right after a ``def`` signature line (and
    its docstring, when it has one); keep the last <= max_tok tokens (>= min_tok required)."""
    prompts = []
    for rel, text in held:
        lines = text.splitlines(keepends=True)
        taken = 0
        offs = [0]
        for ln in lines:
            offs.append(offs[-1] + len(ln))
        i = 0
        while i < len(lines) and taken < 2 and len(prompts) < n:
            s = lines[i].lstrip()
            if s.startswith("def ") and lines[i].rstrip().endswith(":") and offs[i] > 2000:
                end = i + 1
                if end < len(lines) and lines[end].lstrip().startswith(('"""', "'''", 'r"""')):
                    q = '"""' if '"""' in lines[end] else "'''"
                    body = lines[end].strip()
                    if not (body.count(q) >= 2 and len(body) > 6):
                        j = end + 1
                        while j < len(lines) and q not in lines[j]:
                            j += 1
                        end = j
                    end += 1
                ids = encode(tok, text[: offs[min(end, len(lines))]])
                # need a real continuation after the cut
                if len(ids) >= min_tok and end + 3 < len(lines):
                    prompts.append({"file": rel, "line": end, "ids": ids[-max_tok:]})
                    taken += 1
                    i = end + 40  # spread prompts within a file
                    continue
            i += 1
        if len(prompts) >= n:
            break
    return prompts


@torch.no_grad()
def greedy(model, ids: list[int], n_new: int) -> list[int]:
    """Exactly ``n_new`` greedy tokens of ``model`` after ``ids`` (HF ``generate``)."""
    x = torch.tensor([ids])
    out = model.generate(
        input_ids=x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=n_new,
        min_new_tokens=n_new,
        do_sample=False,
        num_beams=1,
        pad_token_id=model.config.pad_token_id,
    )
    return out[0, len(ids) :].tolist()


@torch.no_grad()
def acceptance(target, draft, prompts, k: int = 4, n_new: int = 64, draft_greedy=None) -> dict:
    """Simulate greedy speculative decoding: per round the draft proposes k greedy tokens from the
    current (target-greedy) prefix; accept while equal to the target's greedy tokens; the round then
    appends the target's token (correction or bonus) and restarts. ``draft_greedy(ids, n)`` replaces
    ``greedy(draft, ids, n)`` for drafts that HF ``generate`` cannot run as they are."""
    draft_greedy = draft_greedy or (lambda ids, n: greedy(draft, ids, n))
    accepted = proposed = rounds = 0
    per_prompt = []
    for p in prompts:
        tgt = greedy(target, p["ids"], n_new)
        pos, a_p, pr_p = 0, 0, 0
        while pos < n_new:
            kk = min(k, n_new - pos)
            prop = draft_greedy(p["ids"] + tgt[:pos], kk)
            m = 0
            while m < kk and prop[m] == tgt[pos + m]:
                m += 1
            a_p += m
            pr_p += kk
            rounds += 1
            pos += m + 1
        accepted += a_p
        proposed += pr_p
        per_prompt.append({"file": p["file"], "line": p["line"], "prompt_tokens": len(p["ids"]),
                           "accepted": a_p, "proposed": pr_p})
    return {
        "k": k,
        "new_tokens_per_prompt": n_new,
        "prompts": len(prompts),
        "accepted": accepted,
        "proposed": proposed,
        "rounds": rounds,
        "acceptance_rate": round(accepted / max(1, proposed), 4),
        "tokens_per_round": round(len(prompts) * n_new / max(1, rounds), 3),
        "per_prompt": per_prompt,
    }


@torch.no_grad()
def latency(model, batch: int = 8, ctx: int = 128, reps: int = 20) -> dict:
    """Median forward latency at batch 8: a prefill of ``ctx`` tokens and one cached decode step."""
    from transformers import DynamicCache

    x = torch.randint(4, model.config.vocab_size, (batch, ctx))
    res = {}
    for _ in range(3):
        model(input_ids=x)
    ts = []
    for _ in range(reps // 2):
        t = time.perf_counter()
        model(input_ids=x)
        ts.append(time.perf_counter() - t)
    res["prefill_ms"] = round(1000 * sorted(ts)[len(ts) // 2], 3)
    ts = []
    for _ in range(reps + 3):
        cache = DynamicCache(config=model.config)
        model(input_ids=x, past_key_values=cache, use_cache=True)
        y = torch.randint(4, model.config.vocab_size, (batch, 1))
        t = time.perf_counter()
        model(input_ids=y, past_key_values=cache, use_cache=True)
        ts.append(time.perf_counter() - t)
    ts = ts[3:]
    res["decode_step_ms"] = round(1000 * sorted(ts)[len(ts) // 2], 3)
    res.update(batch=batch, ctx=ctx)
    return res


def dir_size(p: Path) -> int:
    """Total bytes of the files under ``p``."""
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def cpu_name() -> str:
    """The CPU model name from ``lscpu``, else the platform's processor name, else "unknown"."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ----------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    """Train and save the tiny pair with the options in ``argv``; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models/tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--minutes-target", type=float, default=14.0)
    ap.add_argument("--minutes-draft", type=float, default=8.0)
    ap.add_argument("--steps-target", type=int, default=None, help="fixed step count (overrides minutes)")
    ap.add_argument("--steps-draft", type=int, default=None, help="fixed step count (overrides minutes)")
    ap.add_argument("--lr-target", type=float, default=2e-3)
    ap.add_argument("--lr-draft", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--distill-alpha", type=float, default=0.3,
                    help="draft loss = alpha*CE + (1-alpha)*KL(target||draft); 1.0 disables distillation")
    ap.add_argument("--distill-temp", type=float, default=1.0)
    ap.add_argument("--no-bf16", action="store_true", help="train in plain fp32 (default: bf16 autocast)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-windows", type=int, default=200)
    ap.add_argument("--eval-prompts", type=int, default=30)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--eval-only", action="store_true", help="re-evaluate existing checkpoints in --out")
    ap.add_argument("--init-target", default=None,
                    help="continue training from this target checkpoint (its tokenizer is reused)")
    ap.add_argument("--init-draft", default=None, help="continue training from this draft checkpoint")
    ap.add_argument("--target-layers", type=int, default=TARGET_ARCH["num_hidden_layers"])
    ap.add_argument("--draft-layers", type=int, default=DRAFT_ARCH["num_hidden_layers"])
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import __version__ as tf_version

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    tdir, ddir = out / "target", out / "draft"
    t_start = time.perf_counter()

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train_files, held_files = collect_corpus(stdlib)
    train_chars = sum(len(t) for _, t in train_files)
    held_chars = sum(len(t) for _, t in held_files)
    log(f"corpus {stdlib}: {len(train_files)} train files ({train_chars} chars), "
        f"{len(held_files)} held-out files ({held_chars} chars)")

    if args.eval_only:
        tok = AutoTokenizer.from_pretrained(tdir)
    elif args.init_target:
        tok = AutoTokenizer.from_pretrained(args.init_target)
        log(f"tokenizer loaded from {args.init_target}")
    else:
        tok = train_tokenizer([t for _, t in train_files], args.vocab_size)
        log(f"tokenizer trained: vocab {len(tok)}")

    def tokenize_all(files):
        ids: list[int] = []
        for _, text in files:
            ids.extend(encode(tok, text))
            ids.append(tok.eos_token_id)
        return torch.tensor(ids, dtype=torch.int16 if len(tok) < 32768 else torch.int32)

    train_data = tokenize_all(train_files)
    held_data = tokenize_all(held_files)
    log(f"tokens: train {train_data.numel()}, held-out {held_data.numel()} "
        f"({train_chars / train_data.numel():.2f} chars/token)")

    train_info = {}
    target_arch = dict(TARGET_ARCH, num_hidden_layers=args.target_layers)
    draft_arch = dict(DRAFT_ARCH, num_hidden_layers=args.draft_layers)
    if args.eval_only:
        target = AutoModelForCausalLM.from_pretrained(tdir)
        draft = AutoModelForCausalLM.from_pretrained(ddir)
        old = out / "metrics.json"
        if old.exists():
            train_info = json.loads(old.read_text()).get("training", {})
    else:
        if args.init_target:
            target = AutoModelForCausalLM.from_pretrained(args.init_target)
            prev = Path(args.init_target).parent / "metrics.json"
            if prev.exists():
                train_info["stage1"] = json.loads(prev.read_text()).get("training", {})
        else:
            target = make_model(target_arch, tok, args.seed)
        log(f"target params {param_counts(target)}")
        train_info["target"] = train_model(
            "target", target, train_data, seq_len=args.seq_len, batch=args.batch, peak_lr=args.lr_target,
            warmup=args.warmup, steps=args.steps_target, minutes=args.minutes_target, seed=args.seed + 1,
            bf16=not args.no_bf16,
        )
        for p in target.parameters():
            p.requires_grad_(False)
        if args.init_draft:
            draft = AutoModelForCausalLM.from_pretrained(args.init_draft)
        else:
            draft = make_model(draft_arch, tok, args.seed + 100)
        log(f"draft params {param_counts(draft)}")
        train_info["draft"] = train_model(
            "draft", draft, train_data, seq_len=args.seq_len, batch=args.batch, peak_lr=args.lr_draft,
            warmup=args.warmup, steps=args.steps_draft, minutes=args.minutes_draft, seed=args.seed + 2,
            bf16=not args.no_bf16, teacher=None if args.distill_alpha >= 1.0 else target,
            distill_alpha=args.distill_alpha, distill_temp=args.distill_temp,
        )
        for d, m in ((tdir, target), (ddir, draft)):
            d.mkdir(parents=True, exist_ok=True)
            m.save_pretrained(d, safe_serialization=True)
            save_tokenizer(tok, d)
        log(f"saved to {tdir} and {ddir}")
        # reload from disk so the evaluation measures exactly the shipped artifacts
        tok = AutoTokenizer.from_pretrained(tdir)
        target = AutoModelForCausalLM.from_pretrained(tdir)
        draft = AutoModelForCausalLM.from_pretrained(ddir)
    target.eval()
    draft.eval()

    log("evaluating held-out loss")
    ev = {
        "target": heldout_loss(target, held_data, args.seq_len, args.eval_windows),
        "draft": heldout_loss(draft, held_data, args.seq_len, args.eval_windows),
    }
    log(f"held-out: {ev}")
    prompts = make_prompts(tok, held_files, args.eval_prompts)
    log(f"acceptance on {len(prompts)} prompts, k={args.k}")
    acc = acceptance(target, draft, prompts, k=args.k)
    log(f"acceptance rate {acc['acceptance_rate']} ({acc['accepted']}/{acc['proposed']}), "
        f"{acc['tokens_per_round']} tokens/round")
    lat_t, lat_d = latency(target), latency(draft)
    fl_t, fl_d = flops_per_token(target.config), flops_per_token(draft.config)
    pc_t, pc_d = param_counts(target), param_counts(draft)
    cost = {
        "target_latency": lat_t,
        "draft_latency": lat_d,
        "prefill_latency_ratio_b8": round(lat_t["prefill_ms"] / lat_d["prefill_ms"], 2),
        "decode_step_latency_ratio_b8": round(lat_t["decode_step_ms"] / lat_d["decode_step_ms"], 2),
        "target_flops_per_token": fl_t,
        "draft_flops_per_token": fl_d,
        "non_embedding_flops_ratio": round(fl_t["non_embedding_matmul"] / fl_d["non_embedding_matmul"], 2),
        "total_flops_ratio_ctx256": round(fl_t["total"] / fl_d["total"], 2),
        "non_embedding_param_ratio": round(pc_t["non_embedding"] / pc_d["non_embedding"], 2),
        "total_param_ratio": round(pc_t["total"] / pc_d["total"], 2),
    }
    log(f"cost ratios: { {k: v for k, v in cost.items() if 'ratio' in k} }")

    metrics = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": vars(args),
        "seed": args.seed,
        "hardware": {"cpu": cpu_name(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                     "transformers": tf_version, "python": platform.python_version()},
        "corpus": {"stdlib": str(stdlib), "train_files": len(train_files), "heldout_files": len(held_files),
                   "train_chars": train_chars, "heldout_chars": held_chars,
                   "train_tokens": train_data.numel(), "heldout_tokens": held_data.numel(),
                   "heldout_rule": f"sha1(relpath) % {HOLDOUT_MOD} == 0",
                   "heldout_file_list": [r for r, _ in held_files]},
        "tokenizer": {"vocab_size": len(tok), "bos": [BOS, tok.bos_token_id], "eos": [EOS, tok.eos_token_id],
                      "unk": [UNK, tok.unk_token_id], "pad": [PAD, tok.pad_token_id]},
        "params": {"target": pc_t, "draft": pc_d},
        "sizes_bytes": {"target_dir": dir_size(tdir), "draft_dir": dir_size(ddir)},
        "training": train_info,
        "heldout": ev,
        "acceptance": acc,
        "cost": cost,
        "total_wall_s": round(time.perf_counter() - t_start, 1),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log(f"wrote {out / 'metrics.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
