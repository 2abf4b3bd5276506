"""`specserve bench verify` on a tiny random target: proposed tokens are spread over the rows, and every count
is timed and reported against the plain step, greedy and sampled, in-process and (``--served``) as Verify RPCs
to a real target service."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from bench.arguments import int_list, non_negative_int_list
from bench.verify import BATCH_ID, served_verify_calls, shares, start_target_service, verify_calls
from engine.checkpoint import load_checkpoint
from engine.sampling import SamplingParams
from engine.target import TargetRuntime
from specserve.cli import main


def test_list_flags_parse_integers_at_or_above_their_minimum():
    assert int_list("1, 2,4") == [1, 2, 4] and non_negative_int_list("0,3") == [0, 3]
    for bad in ("", "0,1", "a,2"):
        with pytest.raises(argparse.ArgumentTypeError):
            int_list(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        non_negative_int_list("-1")


def test_tokens_are_spread_round_robin():
    assert shares(0, 3) == [0, 0, 0]
    assert shares(5, 3) == [2, 2, 1]
    assert shares(9, 8) == [2, 1, 1, 1, 1, 1, 1, 1]
    assert sum(shares(17, 4)) == 17


@pytest.mark.parametrize(("sampling", "recorded"), [
    (["--temperature", "0"], [0.0, 1.0, 0]), (["--temperature", "0.8"], [0.8, 1.0, 0]),
    (["--temperature", "0.8", "--top-p", "0.9", "--top-k", "20"], [0.8, 0.9, 20])])
def test_bench_verify_reports_every_count_against_the_plain_step(checkpoints, tmp_path, sampling, recorded):
    out = tmp_path / "verify.json"
    status = main(["bench", "verify", "--target-model", str(checkpoints["llama"]), "--rows", "3",
                   "--extra", "1,4,7", "--repeats", "2", *sampling, "--json", str(out)])
    assert status == 0
    result = json.loads(out.read_text())
    assert [result["temperature"], result["top_p"], result["top_k"]] == recorded
    points = result["points"]
    assert [p["extra_tokens"] for p in points] == [0, 1, 4, 7]  # the plain step is always measured
    assert {p["system"] for p in points} == {"packed"}
    assert [p["tokens"] for p in points] == [3, 4, 7, 10]
    assert points[0]["vs_plain"] == 1.0
    assert all(p["ms"] > 0 and p["vs_plain"] > 0 for p in points)
    assert result["rows"] == 3 and result["prompt_tokens"] > 0 and result["host"]["cpu_count"] > 0


def test_bench_verify_times_packed_and_stock_linears_side_by_side(checkpoints, tmp_path, capsys):
    out = tmp_path / "verify.json"
    assert main(["bench", "verify", "--target-model", str(checkpoints["llama"]), "--rows", "2", "--extra", "3",
                 "--repeats", "2", "--linears", "packed,stock", "--json", str(out)]) == 0
    points = json.loads(out.read_text())["points"]
    assert [(p["system"], p["extra_tokens"]) for p in points] == [("packed", 0), ("packed", 3), ("stock", 0),
                                                                   ("stock", 3)]
    assert all(p["ms"] > 0 for p in points)
    assert "stock / packed" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "verify", "--target-model", str(checkpoints["llama"]), "--linears", "fast"])


def test_bench_verify_rejects_an_empty_batch_and_bad_sampling(checkpoints):
    with pytest.raises(SystemExit, match="--rows"):
        main(["bench", "verify", "--target-model", str(checkpoints["llama"]), "--rows", "0"])
    with pytest.raises(SystemExit, match="top_p must be in"):
        main(["bench", "verify", "--target-model", str(checkpoints["llama"]), "--temperature", "0.8", "--top-p", "0"])


def test_the_served_verifies_answer_as_the_in_process_ones(checkpoints):
    """The ``--served`` calls reach a real target service: every count's Verify RPC returns the verdicts of the
    same verify in-process (greedy: the same accepted lengths and next tokens)."""
    model = str(checkpoints["llama"])
    runtime = TargetRuntime(load_checkpoint(model))
    prompt, extras, params = list(range(5, 25)), [0, 3, 5], SamplingParams()
    service, stub = start_target_service(model, "float32")
    try:
        local = verify_calls(runtime, BATCH_ID, prompt, 3, extras, params, repeats=2)
        served = served_verify_calls(stub, BATCH_ID, prompt, 3, extras, params, repeats=2)
        for extra in extras * 2:
            verdicts = [(v.sequence_id, v.accepted_len, v.next_token_id) for v in local[extra]()]
            assert [(v.sequence_id, v.accepted_len, v.next_token_id) for v in served[extra]().verdicts] == verdicts
    finally:
        service.stop()
        runtime.release(BATCH_ID)
    assert service.process.returncode == 0  # stopped by SIGTERM, cleanly


def test_bench_verify_times_the_target_service_beside_the_runtime(checkpoints, tmp_path, capsys):
    out = tmp_path / "verify.json"
    assert main(["bench", "verify", "--target-model", str(checkpoints["llama"]), "--rows", "2", "--extra", "3",
                 "--repeats", "2", "--temperature", "0.8", "--served", "--json", str(out)]) == 0
    points = json.loads(out.read_text())["points"]
    assert [(p["system"], p["extra_tokens"]) for p in points] == [("packed", 0), ("packed", 3), ("served", 0),
                                                                   ("served", 3)]
    assert all(p["ms"] > 0 for p in points)
    captured = capsys.readouterr()
    assert "served / packed" in captured.out
    assert ("GOMP_SPINCOUNT is not set" in captured.err) == ("GOMP_SPINCOUNT" not in os.environ)
