"""Summarise a tools/device_check.sh run: each step's exit status and the measured ratios, in summary.json.

Usage: ``device_summary.py OUT_DIR SECONDS``. Exits 1 when a step failed; a missed goal is reported in the
summary, not a failure.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

GOALS = {"attention_decode": 10.0, "decode_step": 4.0}


def bench_json(out: Path, name: str) -> dict[str, Any] | None:
    """The JSON object a ``--json`` benchmark printed into ``OUT/NAME.log`` (warnings may precede it)."""
    log = out / f"{name}.log"
    text = log.read_text() if log.exists() else ""
    start = text.find("{")
    try:
        return json.loads(text[start:]) if start >= 0 else None
    except json.JSONDecodeError:
        return None


def ratio_entry(ratio: float, median_s: dict[str, float], goal: float | None, **extra: Any) -> dict[str, Any]:
    """One measured ratio (standard over bifurcated) with its medians and, when it has one, its goal."""
    entry = {"ratio_standard_over_bifurcated": ratio, "median_s": median_s, **extra}
    if goal is not None:
        entry.update(goal=goal, goal_met=ratio >= goal)
    return entry


def summarise(out: Path, seconds: int) -> dict[str, Any]:
    """The summary of the run in ``out``; also writes each benchmark's JSON next to its log."""
    lines = (out / "steps.tsv").read_text().splitlines()
    steps = {n: {"rc": int(rc), "seconds": int(s)} for n, rc, s in (line.split("\t") for line in lines)}
    measured: dict[str, Any] = {}
    for name in ("attention_decode", "attention_verify"):
        res = bench_json(out, name)
        if res:
            (out / f"{name}.json").write_text(json.dumps(res, indent=1))
            measured[name] = ratio_entry(res["ratio_standard_over_bifurcated"], res["median_s"], GOALS.get(name),
                                         baseline=res.get("baseline"), max_abs_err=res["max_abs_err"])
    res = bench_json(out, "decode")
    if res and res["points"]:
        (out / "decode.json").write_text(json.dumps(res, indent=1))
        point = res["points"][0]
        measured["decode_step"] = ratio_entry(point["ratio_standard_over_bifurcated"], point["median_s"],
                                              GOALS["decode_step"], baseline=res.get("baseline"))
    if (out / "e2e.json").exists():
        for point in json.loads((out / "e2e.json").read_text())["points"]:
            measured[f"e2e_n{point['n']}_T{point['temperature']:g}"] = {
                system: {k: v[k] for k in ("wall_s", "per_token_ms", "speedup_vs_a", "identical_to_a") if k in v}
                for system, v in point["systems"].items()}
    return {"seconds": seconds, "steps": steps, "measured": measured}


def main(argv: list[str]) -> int:
    """Write and print the summary; 1 when a step failed."""
    out = Path(argv[1])
    summary = summarise(out, int(argv[2]))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 1 if any(step["rc"] for step in summary["steps"].values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
