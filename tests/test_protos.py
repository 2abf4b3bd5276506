"""The committed gRPC stubs are exactly what `make protos` generates from protos/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_stubs_are_fresh(tmp_path):
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos").rglob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iprotos", f"--python_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}", *protos], cwd=ROOT, check=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc generated nothing"
    for relative in generated:
        committed = ROOT / relative
        assert committed.is_file(), f"{relative} is missing: run `make protos`"
        assert committed.read_text() == (tmp_path / relative).read_text(), f"{relative} is stale: run `make protos`"
