"""`specserve bench verify` on a tiny random target: proposed tokens are spread over the rows, and every count
is timed and reported against the plain step, greedy and sampled."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.arguments import int_list, non_negative_int_list
from bench.verify import shares
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
    assert {p["linears"] for p in points} == {"packed"}
    assert [p["tokens"] for p in points] == [3, 4, 7, 10]
    assert points[0]["vs_plain"] == 1.0
    assert all(p["ms"] > 0 and p["vs_plain"] > 0 for p in points)
    assert result["rows"] == 3 and result["prompt_tokens"] > 0 and result["host"]["cpu_count"] > 0


def test_bench_verify_times_packed_and_stock_linears_side_by_side(checkpoints, tmp_path, capsys):
    out = tmp_path / "verify.json"
    assert main(["bench", "verify", "--target-model", str(checkpoints["llama"]), "--rows", "2", "--extra", "3",
                 "--repeats", "2", "--linears", "packed,stock", "--json", str(out)]) == 0
    points = json.loads(out.read_text())["points"]
    assert [(p["linears"], p["extra_tokens"]) for p in points] == [("packed", 0), ("packed", 3), ("stock", 0),
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
