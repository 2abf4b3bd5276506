"""End-to-end generation benchmark: specserve side by side with the alternatives users would pick.

On the same target/draft pair, held-out code prompts (``bench.prompts``) and sampling settings,
in one run, for every n (samples per prompt) and temperature, it times:

* ``a_batched``: specserve's engine, plain batched decoding on the target (the baseline);
* ``b_hf_generate``: HF transformers ``generate`` for the n samples in one batch;
* ``c_hf_assisted``: HF assisted generation (``assistant_model=`` the draft), the n samples one after another;
* ``d_bass_fixed`` / ``d_bass_adaptive``: specserve BASS in-process (DraftRuntime + TargetRuntime), draft
  length fixed at ``--draft-len`` for every sequence (no confidence floor), or adapted by
  ``coordinator.draft_length`` up to ``--max-draft-len`` with the draft's defaults (per-sequence lengths);
* ``d_bass_full_proposals``: as ``d_bass_adaptive`` with the draft's confidence floor off (every proposal
  the round's k long: the batch-wide length alone);
* ``d_bass_model_only``: as ``d_bass_adaptive`` with the draft's prompt lookup off (the draft model alone);
* ``d_bass_gated``: as ``d_bass_adaptive`` with the speculation gate (``coordinator.speculation_gate``);
* ``e_grpc_adaptive``: specserve over its three gRPC services (one Generate request with n samples), the
  speculation gate off (``--speculation-gate off``);
* ``e_grpc_sampled_gate``: as ``e_grpc_adaptive`` with the gate on for batches with a sampled sequence only
  (``--speculation-gate sampled``: greedy batches run the draft's rounds);
* ``e_grpc_default``: as ``e_grpc_adaptive`` with the coordinator's defaults (the gate on for every batch,
  choosing among the draft's, lookup and plain rounds);
* ``e_grpc_lookup``: specserve over gRPC without a draft, the coordinator's own prompt lookup on
  (``coordinator.lookup``: n-gram speculation with no draft model);
* ``e_grpc_target``: specserve over gRPC without a draft and without the coordinator's prompt lookup
  (``--prompt-lookup off``: plain batched decoding, the served baseline);
* ``e_grpc_target_stock``: as ``e_grpc_target`` with the target's linear layers on transformers' own
  ``nn.Linear`` (``SPECSERVE_ONEDNN_LINEAR=0``, no packed weights: ``engine.cpu_linear``).

Every system generates exactly ``--max-new-tokens`` tokens per sample (EOS ignored). The systems are
interleaved (``time_interleaved_samples``) and each figure is the median of ``--repeats``; one call runs
the ``--prompts`` prompts one at a time. Per-token latency = wall time / tokens generated per sequence.
Also: samples finished within a time budget, a memory-bandwidth roofline for (a), and a profile of where
a BASS round spends its time. Results go to ``--json``, ``--markdown`` and ``--plot``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.arguments import comma_items, int_list
from bench.prompts import code_prompts
from bench.speculative import RunStats, engine_bass, engine_batched, hf_assistant, hf_assisted, hf_generate
from bench.timing import format_bytes, host_info, time_interleaved_samples
from coordinator.draft_length import DraftLength
from coordinator.speculation_gate import SpeculationGate
from deployment.arguments import add_model_pair_arguments, resolve_model_pair
from engine.checkpoint import AUTO_DTYPE, DTYPES, load_checkpoint
from engine.device import resolve_device
from engine.draft import DraftRuntime
from engine.sampling import SamplingParams
from engine.target import TargetRuntime

SYSTEMS: dict[str, str] = {
    "a_batched": "(a) specserve batched decoding (target only)",
    "b_hf_generate": "(b) HF generate, n samples batched",
    "c_hf_assisted": "(c) HF assisted generation, n sequential",
    "d_bass_fixed": "(d) BASS in-process, fixed k",
    "d_bass_adaptive": "(d) BASS in-process, adaptive k",
    "d_bass_full_proposals": "(d) BASS in-process, adaptive k, no confidence floor (every proposal k long)",
    "d_bass_model_only": "(d) BASS in-process, adaptive k, draft model alone (no prompt lookup)",
    "d_bass_gated": "(d) BASS in-process, adaptive k, speculation gate (plain rounds where faster)",
    "e_grpc_adaptive": "(e) BASS over gRPC, adaptive k, speculation gate off",
    "e_grpc_sampled_gate": "(e) BASS over gRPC, adaptive k, speculation gate on sampled batches only",
    "e_grpc_default": "(e) BASS over gRPC, the coordinator's defaults (gate on every batch)",
    "e_grpc_lookup": "(e) target only over gRPC, the coordinator's prompt lookup (no draft model)",
    "e_grpc_target": "(e) target only over gRPC, plain decoding",
    "e_grpc_target_stock": "(e) target only over gRPC, plain decoding, nn.Linear (no packed weights)",
}
IN_PROCESS_BASS = ("d_bass_fixed", "d_bass_adaptive", "d_bass_full_proposals", "d_bass_model_only", "d_bass_gated")
# system -> (the deployment has a draft, the coordinator's extra flags, the servers' extra environment)
GRPC_SYSTEMS: dict[str, tuple[bool, list[str], dict[str, str]]] = {
    "e_grpc_adaptive": (True, ["--speculation-gate", "off"], {}),
    "e_grpc_sampled_gate": (True, ["--speculation-gate", "sampled"], {}),
    "e_grpc_default": (True, [], {}),
    "e_grpc_lookup": (False, [], {}),
    "e_grpc_target": (False, ["--prompt-lookup", "off"], {}),
    "e_grpc_target_stock": (False, ["--prompt-lookup", "off"], {"SPECSERVE_ONEDNN_LINEAR": "0"}),
}
GRPC_BASELINE = "e_grpc_target"
BASS = "d_bass_adaptive"  # the configuration the bars are judged on (the coordinator's default)

Output = list[list[list[int]]]  # [prompt][sample] -> token ids


def _float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in comma_items(text)]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of temperatures >= 0, got {text!r}")
    return values


def _system_list(text: str) -> list[str]:
    names = comma_items(text)
    unknown = [v for v in names if v not in SYSTEMS]
    if unknown or "a_batched" not in names:
        raise argparse.ArgumentTypeError(f"systems must include a_batched and be among {list(SYSTEMS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the options of ``specserve bench e2e``."""
    add_model_pair_arguments(parser)
    parser.add_argument("--n", type=int_list, default=[1, 2, 4, 8, 16], help="comma-separated samples per prompt")
    parser.add_argument("--temperatures", type=_float_list, default=[0.0, 0.8], help="comma-separated; 0 = greedy")
    parser.add_argument("--draft-len", type=int, default=4, help="fixed k, and the adaptive rule's initial k")
    parser.add_argument("--max-draft-len", type=int, default=8, help="upper bound of the adaptive k")
    parser.add_argument("--prompts", type=int, default=2, help="held-out code prompts, run one at a time")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed repeats (medians reported)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", type=_system_list, default=list(SYSTEMS),
                        help=f"comma-separated subset of {','.join(SYSTEMS)} (a_batched is required)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads here and OMP_NUM_THREADS of the gRPC services (default: torch's)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="time budget of the samples-within-budget table (default: (a)'s wall time for the largest "
                             "measured n <= max(n)/2, i.e. the time (a) needs for half of the samples)")
    parser.add_argument("--bandwidth-mb", type=int, default=256, help="tensor size of the memory bandwidth probe")
    parser.add_argument("--device", default="cpu",
                        help="device of the in-process engine systems (a, d); the HF and gRPC systems need cpu")
    parser.add_argument("--dtype", default=AUTO_DTYPE, choices=[AUTO_DTYPE, *DTYPES],
                        help="weights and KV dtype of every specserve system, in-process and the gRPC services "
                             "(auto, as `serve`: each checkpoint's saved dtype where the device computes in it "
                             "natively, else float32)")
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile of a BASS run")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--json", default=None, help="write all results (with outputs) to this path")
    parser.add_argument("--markdown", default=None, help="write the markdown tables to this path")
    parser.add_argument("--plot", default=None, help="write a PNG (per-token latency vs n) to this path")


class Harness:
    """The loaded models, runtimes and (optionally) a gRPC deployment that every system call runs on."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        device = resolve_device(args.device)
        if device.type != "cpu" and set(args.systems) - {"a_batched", *IN_PROCESS_BASS}:
            raise SystemExit(f"--device {args.device} runs only the systems a_batched, {', '.join(IN_PROCESS_BASS)}")
        self.target = load_checkpoint(args.target_model, args.dtype, device)
        self.draft = load_checkpoint(args.draft_model, args.dtype, device)
        if self.target.tokenizer is None:
            raise SystemExit(f"{args.target_model} has no tokenizer: the code prompts need one")
        self.target_runtime = TargetRuntime(self.target)
        default, full = DraftRuntime(self.draft), DraftRuntime(self.draft, confidence_floor=0.0)
        self.draft_runtimes = {"d_bass_fixed": full, "d_bass_adaptive": default, "d_bass_full_proposals": full,
                               "d_bass_model_only": DraftRuntime(self.draft, prompt_lookup=None),
                               "d_bass_gated": default}
        # HF's systems run transformers' own modules, not the engine's packed linear layers
        hf_systems = {"b_hf_generate", "c_hf_assisted"} & set(args.systems)
        self.hf_target = load_checkpoint(args.target_model, args.dtype, device, packed_linears=False).model \
            if hf_systems else None
        self.assistant = hf_assistant(load_checkpoint(args.draft_model, args.dtype, device, packed_linears=False)) \
            if "c_hf_assisted" in args.systems else None
        self.prompts = code_prompts(self.target.tokenizer, args.prompts)
        self.deployments: dict[str, Any] = {}
        self.stubs: dict[str, Any] = {}

    def start_grpc(self, systems: list[str]) -> None:
        """Start a deployment for each gRPC system in ``systems``: draft (adaptive k, the bench's k settings),
        target and coordinator, or target and coordinator alone."""
        import grpc

        from deployment.processes import Deployment
        from specserve.v1 import coordinator_pb2_grpc

        threads = {"OMP_NUM_THREADS": str(self.args.threads)} if self.args.threads else {}
        for system in (s for s in systems if s in GRPC_SYSTEMS):
            log_dir = Path(tempfile.mkdtemp(prefix=f"specserve-bench-{system}-"))
            has_draft, flags, env = GRPC_SYSTEMS[system]
            deployment = Deployment(self.args.target_model, self.args.draft_model if has_draft else None,
                                    log_dir=log_dir, env={**threads, **env} or None,
                                    # no prefix cache: the repeats reuse prompts, and the in-process systems
                                    # prefill every request, so both sides do the same work
                                    model_args=["--dtype", self.args.dtype, "--prefix-cache-mb", "0"],
                                    coordinator_args=["--draft-len", str(self.args.draft_len),
                                                      "--max-draft-len", str(self.args.max_draft_len), *flags])
            self.deployments[system] = deployment.start()
            self.stubs[system] = coordinator_pb2_grpc.CoordinatorStub(
                grpc.insecure_channel(deployment.coordinator_address))

    def stop(self) -> None:
        """Stop the gRPC deployments that run."""
        for deployment in self.deployments.values():
            deployment.stop()

    def call(self, system: str, n: int, temperature: float, max_new: int, prompts: list[list[int]]
             ) -> tuple[Output, RunStats]:
        """Run ``system`` on each prompt in turn (n samples each); returns the outputs and summed stats."""
        a = self.args
        params = SamplingParams(temperature=temperature, seed=a.seed)
        outputs: Output = []
        total = RunStats()
        for prompt in prompts:
            if system == "a_batched":
                out, stats = engine_batched(self.target_runtime, prompt, n, params, max_new)
            elif system == "b_hf_generate":
                out, stats = hf_generate(self.hf_target, prompt, n, temperature, max_new, a.seed)
            elif system == "c_hf_assisted":
                out, stats = hf_assisted(self.hf_target, self.assistant, prompt, n, temperature, max_new, a.seed)
            elif system in IN_PROCESS_BASS:
                length = DraftLength(a.draft_len, max(a.draft_len, a.max_draft_len), system != "d_bass_fixed",
                                     SpeculationGate() if system == "d_bass_gated" else None)
                out, stats = engine_bass(self.target_runtime, self.draft_runtimes[system], prompt, n, params, max_new,
                                         length)
            elif system in GRPC_SYSTEMS:
                out, stats = self._grpc(system, prompt, n, temperature, max_new)
            else:
                raise ValueError(f"unknown system {system!r}")
            if len(out) != n or any(len(s) != max_new for s in out):
                raise RuntimeError(f"{system} returned {[len(s) for s in out]} tokens, expected {n} x {max_new}")
            outputs.append(out)
            total.add(stats)
        return outputs, total

    def _grpc(self, system: str, prompt: list[int], n: int, temperature: float, max_new: int
              ) -> tuple[list[list[int]], RunStats]:
        from specserve.v1 import coordinator_pb2

        start = time.perf_counter()
        request = coordinator_pb2.GenerateRequest(prompt_token_ids=prompt, n=n, max_new_tokens=max_new,
                                                  temperature=temperature, top_p=1.0, seed=self.args.seed,
                                                  ignore_eos=True)
        response = self.stubs[system].Generate(request, timeout=3600)
        completions = sorted(response.completions, key=lambda c: c.index)
        usage = response.usage
        # speculative tokens of either source: the draft's, and the coordinator's lookup in draft-free rounds
        stats = RunStats(rounds=usage.rounds, proposed=usage.draft_tokens_proposed + usage.lookup_tokens_proposed,
                         accepted=usage.draft_tokens_accepted + usage.lookup_tokens_accepted,
                         total_s=time.perf_counter() - start)
        return [list(c.token_ids) for c in completions], stats


def _fingerprint(path: str) -> dict[str, str]:
    """The checkpoint directory and the first 16 hex digits of its weights' SHA-256 (which models were timed)."""
    import hashlib

    weights = Path(path) / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()[:16] if weights.is_file() else ""
    return {"path": str(path), "sha256": digest}


def measure_bandwidth(megabytes: int, repeats: int = 7) -> float:
    """Median GB/s (1e9 bytes/s) of copying a ``megabytes`` MB float32 tensor (read + write counted)."""
    numel = megabytes * 1_000_000 // 4
    src = torch.ones(numel)
    dst = torch.empty_like(src)
    dst.copy_(src)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        rates.append(2 * src.nbytes / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if not num or not den else num / den


def finished_within(walls: dict[int, float], budget_s: float, n_max: int) -> tuple[int, int | None]:
    """Samples (at most ``n_max``) a system finishes within ``budget_s`` when it runs back-to-back batches of
    the best measured size n' (``walls``: n' -> wall seconds): max over n' of min(n_max, n' * floor(B / wall)).
    Returns (samples, the n' achieving it or None)."""
    best, best_n = 0, None
    for n, wall in sorted(walls.items()):
        done = min(n_max, n * int(budget_s // wall)) if wall > 0 else 0
        if done > best:
            best, best_n = done, n
    return best, best_n


def profile_bass(harness: Harness, n: int, temperature: float, top: int = 15) -> dict[str, Any]:
    """cProfile of one BASS (adaptive) call on the first prompt: top entries by own time and the round's
    split into draft propose, target verify and the rest (Python loop, bookkeeping)."""
    prompt = harness.prompts[0].token_ids
    profiler = cProfile.Profile()
    profiler.enable()
    _, stats = harness.call(BASS, n, temperature, harness.args.max_new_tokens, [prompt])
    profiler.disable()
    stream = io.StringIO()
    table = pstats.Stats(profiler, stream=stream)
    entries = []
    for (file, line, func), (_, calls, tottime, cumtime, _) in sorted(
            table.stats.items(), key=lambda item: item[1][2], reverse=True)[:top]:
        entries.append({"function": f"{Path(file).name}:{line}({func})", "calls": calls,
                        "tottime_s": round(tottime, 4), "cumtime_s": round(cumtime, 4)})
    return {"n": n, "temperature": temperature, "top_by_tottime": entries, **_split(stats)}


def _split(stats: RunStats) -> dict[str, float]:
    other = max(stats.total_s - stats.draft_s - stats.target_s, 0.0)
    total = stats.total_s or 1.0
    return {"total_s": stats.total_s, "draft_s": stats.draft_s, "target_s": stats.target_s, "other_s": other,
            "draft_share": stats.draft_s / total, "target_share": stats.target_s / total, "other_share": other / total,
            "rounds": stats.rounds}


def run_e2e(args: argparse.Namespace) -> dict[str, Any]:
    """Run every (temperature, n) point with all selected systems interleaved; returns the result dict.

    Guarantees: every system generated exactly max_new_tokens per sample on the same prompts; medians over
    ``--repeats``; ``outputs`` hold the last repeat's tokens ([prompt][sample]) for each system and point.
    """
    resolve_model_pair(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    harness = Harness(args)
    systems = list(args.systems)
    m = args.max_new_tokens
    prompts = [p.token_ids for p in harness.prompts]
    result: dict[str, Any] = {
        "host": host_info(),
        "config": {k: v for k, v in vars(args).items() if not callable(v)},
        "systems": {s: SYSTEMS[s] for s in systems},
        "models": {role: _fingerprint(path) for role, path in (("target", args.target_model),
                                                                 ("draft", args.draft_model))},
        "prompts": [{"file": p.file, "line": p.line, "tokens": len(p.token_ids)} for p in harness.prompts],
        "points": [],
    }
    total_calls = len(args.temperatures) * len(args.n) * args.repeats * len(systems)
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=total_calls, desc="bench e2e", unit="call", file=sys.stderr)
    try:
        harness.start_grpc(systems)
        for system in systems:  # warm-up: first calls load kernels, allocate, connect
            for temperature in args.temperatures:
                harness.call(system, min(args.n), temperature, min(m, 8), prompts[:1])
        for temperature in args.temperatures:
            for n in args.n:
                last: dict[str, tuple[Output, RunStats]] = {}

                def make(system: str, n: int = n, temperature: float = temperature,
                         last: dict[str, tuple[Output, RunStats]] = last) -> Callable[[], None]:
                    def fn() -> None:
                        last[system] = harness.call(system, n, temperature, m, prompts)
                        if progress is not None:
                            progress.set_postfix_str(f"T={temperature:g} n={n} {system}")
                            progress.update(1)
                    return fn

                samples = time_interleaved_samples({s: make(s) for s in systems}, args.repeats, warmup=0)
                result["points"].append(_point(temperature, n, m, len(prompts), samples, last))
        if not args.no_profile and BASS in systems:
            n_prof = min(args.n, key=lambda v: abs(v - 8))
            result["profile"] = profile_bass(harness, n_prof, min(args.temperatures))
    finally:
        if progress is not None:
            progress.close()
        harness.stop()
    result["budget"] = _budget(result, args)
    result["roofline"] = _roofline(result, harness, args)
    result["bars"] = _bars(result)
    return result


def _point(temperature: float, n: int, m: int, num_prompts: int, samples: dict[str, list[float]],
           last: dict[str, tuple[Output, RunStats]]) -> dict[str, Any]:
    point: dict[str, Any] = {"temperature": temperature, "n": n, "systems": {}}
    for system, walls in samples.items():
        wall = statistics.median(walls)
        outputs, stats = last[system]
        entry: dict[str, Any] = {
            "wall_s": wall, "wall_s_samples": walls,
            "per_token_ms": 1000 * wall / (num_prompts * m),
            "tokens_per_s": num_prompts * n * m / wall,
            "outputs": outputs,
        }
        if stats.proposed:
            entry.update(rounds=stats.rounds, draft_tokens_proposed=stats.proposed,
                         draft_tokens_accepted=stats.accepted, acceptance=stats.accepted / stats.proposed,
                         tokens_per_round=(num_prompts * n * m) / max(stats.rounds * n, 1))
        if system.startswith("d_"):
            entry["time_split"] = _split(stats)
            entry["mean_draft_len"] = statistics.mean(stats.draft_lens) if stats.draft_lens else 0.0
            entry["plain_rounds"] = stats.draft_lens.count(0)
        if system == "a_batched":
            entry["steps"] = stats.rounds + num_prompts  # verify steps + prefills
        point["systems"][system] = entry
    systems = point["systems"]
    a = systems["a_batched"]["wall_s"]
    b = systems.get("b_hf_generate", {}).get("wall_s")
    for entry in systems.values():
        entry["speedup_vs_a"] = _ratio(a, entry["wall_s"])
        entry["speedup_vs_b"] = _ratio(b, entry["wall_s"])
        entry["identical_to_a"] = entry["outputs"] == systems["a_batched"]["outputs"]
    if "e_grpc_adaptive" in systems and BASS in systems:
        point["grpc_overhead"] = systems["e_grpc_adaptive"]["wall_s"] / systems[BASS]["wall_s"] - 1
    if GRPC_BASELINE in systems:
        for system in (s for s in GRPC_SYSTEMS if s != GRPC_BASELINE and s in systems):
            served = systems[system]
            served["speedup_vs_grpc_target"] = _ratio(systems[GRPC_BASELINE]["wall_s"], served["wall_s"])
            served["identical_to_grpc_target"] = served["outputs"] == systems[GRPC_BASELINE]["outputs"]
    return point


def _budget(result: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    n_max = max(args.n)
    rows = []
    for temperature in args.temperatures:
        points = [p for p in result["points"] if p["temperature"] == temperature]
        walls = {s: {p["n"]: p["systems"][s]["wall_s"] for p in points} for s in args.systems}
        half = max([n for n in walls["a_batched"] if n <= n_max / 2] or [min(walls["a_batched"])])
        budget = args.budget_s or walls["a_batched"][half]  # the time (a) needs for (about) half of n_max
        row: dict[str, Any] = {"temperature": temperature, "n_max": n_max, "budget_s": budget, "systems": {}}
        for system, by_n in walls.items():
            done, best_n = finished_within(by_n, budget, n_max)
            row["systems"][system] = {"finished": done, "batch_size": best_n}
        rows.append(row)
    return rows


def _roofline(result: dict[str, Any], harness: Harness, args: argparse.Namespace) -> dict[str, Any]:
    bandwidth = measure_bandwidth(args.bandwidth_mb)
    runtime = harness.target_runtime
    params = {p.data_ptr(): p for p in harness.target.model.parameters()}  # tied weights counted once
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    prompt_len = statistics.mean(len(p.token_ids) for p in harness.prompts)
    m = args.max_new_tokens
    rows = []
    for point in result["points"]:
        a = point["systems"]["a_batched"]
        n = point["n"]
        kv = (prompt_len + n * m / 2) * runtime.token_kv_bytes  # prompt KV once + mean decode KV of n rows
        step_s = a["wall_s"] / a["steps"]
        floor_s = (weight_bytes + kv) / (bandwidth * 1e9)
        rows.append({"temperature": point["temperature"], "n": n, "step_ms": 1000 * step_s,
                     "bytes_per_step": weight_bytes + kv, "kv_bytes_per_step": kv,
                     "bandwidth_floor_ms": 1000 * floor_s, "achieved_fraction": floor_s / step_s})
    return {"bandwidth_gb_s": bandwidth, "probe_mb": args.bandwidth_mb, "target_weight_bytes": weight_bytes,
            "token_kv_bytes": runtime.token_kv_bytes, "mean_prompt_tokens": prompt_len, "points": rows}


def _bars(result: dict[str, Any]) -> dict[str, Any]:
    points = result["points"]
    bars: dict[str, Any] = {}
    greedy8 = [p for p in points if p["temperature"] == 0 and p["n"] == 8 and BASS in p["systems"]]
    if greedy8:
        speedup = greedy8[0]["systems"][BASS]["speedup_vs_a"]
        bars["bass_2x_vs_a_at_n8_greedy"] = {"value": speedup, "met": speedup >= 2.0}
    for p in points:
        for system, name in (("e_grpc_adaptive", "grpc_bass"), ("e_grpc_sampled_gate", "grpc_sampled_gate_bass"),
                             ("e_grpc_default", "grpc_default_bass")):
            served = p["systems"].get(system, {})
            if p["n"] == 8 and "speedup_vs_grpc_target" in served:
                greedy = p["temperature"] == 0
                goal = 2.15 if greedy else 1.5
                bar = {"value": served["speedup_vs_grpc_target"], "goal": goal}
                bar["met"] = bar["value"] >= goal and (served["identical_to_grpc_target"] or not greedy)
                bars[f"{name}_vs_grpc_target_at_n8_T{p['temperature']:g}"] = bar
    faster = []
    for p in points:
        if p["n"] < 2 or BASS not in p["systems"]:
            continue
        d = p["systems"][BASS]["wall_s"]
        for other in ("b_hf_generate", "c_hf_assisted"):
            if other in p["systems"]:
                faster.append({"temperature": p["temperature"], "n": p["n"], "vs": other,
                               "speedup": p["systems"][other]["wall_s"] / d})
    if faster:
        bars["bass_faster_than_b_and_c_at_n_ge_2"] = {"met": all(f["speedup"] > 1 for f in faster),
                                                      "cases": faster}
    overheads = [p["grpc_overhead"] for p in points if "grpc_overhead" in p]
    if overheads:
        bars["grpc_overhead_under_10pct"] = {"max": max(overheads), "median": statistics.median(overheads),
                                             "met": max(overheads) < 0.10}
    return bars


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def markdown(result: dict[str, Any]) -> str:
    """The result as markdown tables (latency per system, ratios, budget, roofline, profile, bars)."""
    host = result["host"]
    cfg = result["config"]
    systems = list(result["systems"])
    lines = [f"Hardware: {host['cpu']}, {host['cpu_count']} cores, torch {host['torch']}, "
             f"{host['torch_threads']} torch threads, load average {host.get('loadavg_1m', '?')} at start. "
             f"{cfg['prompts']} prompts × {cfg['max_new_tokens']} new tokens, median of {cfg['repeats']} "
             f"interleaved repeats; k = {cfg['draft_len']} fixed, adaptive up to {cfg['max_draft_len']}.", ""]
    lines += ["Systems: " + "; ".join(f"`{s}` = {result['systems'][s]}" for s in systems) + ".", ""]
    temperatures = sorted({p["temperature"] for p in result["points"]})
    for temperature in temperatures:
        points = [p for p in result["points"] if p["temperature"] == temperature]
        title = "greedy" if temperature == 0 else f"T = {temperature:g}"
        lines += [f"**Per-token latency per sequence (ms), {title}** (wall / tokens per sequence; lower is better)",
                  "", "| n | " + " | ".join(f"`{s}`" for s in systems) + " |",
                  "|---|" + "---:|" * len(systems)]
        for p in points:
            lines.append(f"| {p['n']} | " + " | ".join(_fmt(p["systems"][s]["per_token_ms"], ".1f")
                                                     for s in systems) + " |")
        served = [g for g in GRPC_SYSTEMS if g != GRPC_BASELINE and any(g in p["systems"] for p in points)]
        lines += ["", f"**Ratios, {title}** (speed-up = other wall / BASS wall; tokens/s of all n samples; "
                  "`e_*` vs (e): the served system against the target alone over gRPC)", "",
                  "| n | BASS tok/s | BASS vs (a) | BASS vs (b) | BASS vs (c) | fixed-k vs (a) | no floor vs (a) "
                  "| no lookup vs (a) "
                  "| gated vs (a) (plain rounds) "
                  "| gRPC overhead (e)/(d) | " + "".join(f"`{g}` vs (e) | " for g in served)
                  + "acceptance (no lookup) | mean k | greedy (d),(e) = (a) |",
                  "|---|" + "---:|" * (11 + len(served)) + "---|"]
        for p in points:
            s = p["systems"]
            d = s.get(BASS, {})
            dw = d.get("wall_s")
            vs = [_ratio(s[o]["wall_s"], dw) if o in s else None for o in ("a_batched", "b_hf_generate",
                                                                           "c_hf_assisted")]
            fixed = s.get("d_bass_fixed", {}).get("speedup_vs_a")
            full = s.get("d_bass_full_proposals", {}).get("speedup_vs_a")
            alone = s.get("d_bass_model_only", {})
            gated = s.get("d_bass_gated", {})
            same = "–" if temperature else ("yes" if all(s[x]["identical_to_a"] for x in s
                                                         if x.startswith(("d_", "e_"))) else "**no**")
            lines.append(f"| {p['n']} | {_fmt(d.get('tokens_per_s'), '.0f')} | {_fmt(vs[0], '.2f', '×')} | "
                         f"{_fmt(vs[1], '.2f', '×')} | {_fmt(vs[2], '.2f', '×')} | {_fmt(fixed, '.2f', '×')} | "
                         f"{_fmt(full, '.2f', '×')} | "
                         f"{_fmt(alone.get('speedup_vs_a'), '.2f', '×')} | "
                         f"{_fmt(gated.get('speedup_vs_a'), '.2f', '×')} ({gated.get('plain_rounds', '–')}) | "
                         f"{_fmt(p.get('grpc_overhead', None) and 100 * p['grpc_overhead'], '+.1f', '%')} | "
                         + "".join(f"{_fmt(s.get(g, {}).get('speedup_vs_grpc_target'), '.2f', '×')} | " for g in served)
                         + f"{_fmt(d.get('acceptance'), '.2f')} ({_fmt(alone.get('acceptance'), '.2f')}) | "
                         f"{_fmt(d.get('mean_draft_len'), '.1f')} | {same} |")
        lines.append("")
    budget = result.get("budget") or []
    if budget:
        lines += ["**Samples finished within a time budget** (of n_max; back-to-back batches of the best measured "
                  "size n', shown in parentheses)", "",
                  "| temperature | budget (s) | " + " | ".join(f"`{s}`" for s in systems) + " |",
                  "|---|---:|" + "---:|" * len(systems)]
        for row in budget:
            cells = [f"{row['systems'][s]['finished']}/{row['n_max']} (n'={row['systems'][s]['batch_size'] or '–'})"
                     for s in systems]
            lines.append(f"| {row['temperature']:g} | {row['budget_s']:.2f} | " + " | ".join(cells) + " |")
        lines.append("")
    roof = result.get("roofline")
    if roof:
        lines += [f"**Roofline of (a)**: copy bandwidth {roof['bandwidth_gb_s']:.1f} GB/s ({roof['probe_mb']} MB "
                  f"tensor copy, read + write); target weights {format_bytes(roof['target_weight_bytes'])}, "
                  f"KV {roof['token_kv_bytes']} B/token, mean prompt {roof['mean_prompt_tokens']:.0f} tokens.", "",
                  "| temperature | n | step (ms) | bytes/step | bandwidth floor (ms) | achieved fraction |",
                  "|---|---:|---:|---:|---:|---:|"]
        for row in roof["points"]:
            lines.append(f"| {row['temperature']:g} | {row['n']} | {row['step_ms']:.2f} | "
                         f"{format_bytes(row['bytes_per_step'])} | {row['bandwidth_floor_ms']:.3f} | "
                         f"{100 * row['achieved_fraction']:.1f}% |")
        lines.append("")
    split_rows = [(p["temperature"], p["n"], p["systems"][s]["time_split"], s,
                   1000 * p["systems"]["a_batched"]["wall_s"] / p["systems"]["a_batched"]["steps"])
                  for p in result["points"] for s in IN_PROCESS_BASS if s in p["systems"]]
    if split_rows:
        lines += ["**Where a BASS call spends its time** (last repeat; prefill counted as target)", "",
                  "| system | temperature | n | rounds | draft | target | Python/other | ms per round "
                  "| draft ms/round | target ms/round | (a) ms/step |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for temperature, n, sp, system, a_step in split_rows:
            per = 1000 / max(sp["rounds"], 1)
            lines.append(f"| `{system}` | {temperature:g} | {n} | {sp['rounds']} | {100 * sp['draft_share']:.0f}% | "
                         f"{100 * sp['target_share']:.0f}% | {100 * sp['other_share']:.0f}% | "
                         f"{per * sp['total_s']:.1f} | {per * sp['draft_s']:.1f} | {per * sp['target_s']:.1f} | "
                         f"{a_step:.1f} |")
        lines.append("")
    prof = result.get("profile")
    if prof:
        lines += [f"**cProfile of one `{BASS}` call** (n = {prof['n']}, T = {prof['temperature']:g}, "
                  f"first prompt; top by own time)", "", "| function | calls | own (s) | cumulative (s) |",
                  "|---|---:|---:|---:|"]
        for e in prof["top_by_tottime"]:
            lines.append(f"| `{e['function']}` | {e['calls']} | {e['tottime_s']:.3f} | {e['cumtime_s']:.3f} |")
        lines.append("")
    bars = result.get("bars") or {}
    if bars:
        lines += ["**Bars**", ""]
        for name, bar in bars.items():
            detail = ", ".join(f"{k} {v:.3g}" for k, v in bar.items() if isinstance(v, float))
            lines.append(f"- `{name}`: {'met' if bar['met'] else '**missed**'}" + (f" ({detail})" if detail else ""))
        lines.append("")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """Write per-token latency vs n, one line per system, one panel per temperature, to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({p["temperature"] for p in result["points"]})
    fig, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 4.5), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures, strict=True):
        points = [p for p in result["points"] if p["temperature"] == temperature]
        for system in result["systems"]:
            ax.plot([p["n"] for p in points], [p["systems"][system]["per_token_ms"] for p in points], marker="o",
                    label=result["systems"][system])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("samples per prompt n")
        ax.set_ylabel("per-token latency per sequence (ms)")
        ax.set_title("greedy" if temperature == 0 else f"temperature {temperature:g}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """``specserve bench e2e``: run, print the markdown tables, write ``--json``/``--markdown``/``--plot``."""
    result = run_e2e(args)
    text = markdown(result)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n", encoding="utf-8")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    if args.plot:
        plot(result, args.plot)
    return 0
