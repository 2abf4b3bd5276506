"""The Dockerfile: one multi-stage image whose command picks the role, and its gRPC health check."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tomllib
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from cli_parsing import parse_cli
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs of a Dockerfile: comments dropped, continuation lines joined."""
    joined = re.sub(r"\\\n", "", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    result = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def stages(text: str) -> list[list[tuple[str, str]]]:
    """The instructions of each build stage (from one FROM to the next)."""
    result: list[list[tuple[str, str]]] = []
    for keyword, rest in instructions(text):
        if keyword == "FROM":
            result.append([])
        if result:
            result[-1].append((keyword, rest))
    return result


def exec_form(arguments: str) -> list[str]:
    value = json.loads(arguments)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"not exec form: {arguments}"
    return value


def healthcheck_code(text: str) -> str:
    ((_, arguments),) = [(k, r) for k, r in stages(text)[-1] if k == "HEALTHCHECK"]
    options, _, command = arguments.partition("CMD ")
    assert "--timeout=" in options and "--start-period=" in options
    argv = exec_form(command)
    assert argv[:2] == ["python", "-c"]
    return argv[2]



@pytest.fixture(scope="module")
def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_multi_stage_build_with_torch_variant(dockerfile: str) -> None:
    builder, runtime = stages(dockerfile)
    assert builder[0][1].endswith("AS builder") and runtime[0][1].endswith("AS runtime")
    args = dict(rest.partition("=")[::2] for keyword, rest in builder if keyword == "ARG")
    assert args["TORCH_VARIANT"] == "cpu"
    assert "${TORCH_VARIANT}" in args["TORCH_INDEX_URL"]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (torch_pin,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("torch==")]
    assert args["TORCH_VERSION"] == torch_pin.removeprefix("torch==")
    runs = " ".join(rest for keyword, rest in builder if keyword == "RUN")
    assert '--index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in runs
    assert "pip install ." in runs
    assert any(k == "COPY" and r.startswith("--from=builder") for k, r in runtime)
    assert "ARG BASE_IMAGE=" in dockerfile  # the base image is a build argument too


def test_runtime_runs_as_non_root_without_models(dockerfile: str) -> None:
    runtime = stages(dockerfile)[-1]
    (user,) = [rest for keyword, rest in runtime if keyword == "USER"]
    assert user.split(":")[0] not in ("0", "root")
    copies = [rest for keyword, rest in stages(dockerfile)[0] + runtime if keyword == "COPY"]
    assert not any("models" in copy.split() for copy in copies), "models must be mounted, not baked in"
    exposed = {int(port) for keyword, rest in runtime if keyword == "EXPOSE" for port in rest.split()}
    assert {50050, 50051, 50052, 9464} <= exposed


def test_copied_sources_exist_and_are_not_dockerignored(dockerfile: str) -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".venv", "models", ".git", "tests", "**/__pycache__"} <= ignored
    for keyword, rest in stages(dockerfile)[0]:
        if keyword == "COPY" and not rest.startswith("--"):
            *sources, _ = rest.split()
            for source in sources:
                assert (ROOT / source).exists(), source
                assert source not in ignored, source
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for package in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert f"COPY {package.rstrip('*')} " in dockerfile, f"package {package} is not copied into the image"


def test_entrypoint_and_default_command(dockerfile: str) -> None:
    runtime = stages(dockerfile)[-1]
    (entrypoint,) = [exec_form(rest) for keyword, rest in runtime if keyword == "ENTRYPOINT"]
    assert entrypoint == ["specserve"]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["specserve"] == "specserve.cli:main"
    (command,) = [exec_form(rest) for keyword, rest in runtime if keyword == "CMD"]
    args = parse_cli(command, "the Dockerfile CMD")
    assert (args.command, args.role, args.host) == ("serve", "coordinator", "0.0.0.0")
    assert args.target and args.draft


@pytest.fixture
def health_server() -> Any:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(None)


def run_healthcheck(code: str, port: int) -> int:
    env = {**os.environ, "SPECSERVE_HEALTH_PORT": str(port), "SPECSERVE_HEALTH_TIMEOUT": "3"}
    env = {k: v for k, v in env.items() if not k.startswith("SPECSERVE_TLS_")}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=30).returncode


def test_healthcheck_follows_grpc_health(dockerfile: str, health_server: Any) -> None:
    code = healthcheck_code(dockerfile)
    servicer, port = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert run_healthcheck(code, port) == 1
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert run_healthcheck(code, port) == 0


def test_healthcheck_fails_without_a_server(dockerfile: str) -> None:
    with socket.socket() as unused:  # bound, never listening: connections are refused
        unused.bind(("127.0.0.1", 0))
        assert run_healthcheck(healthcheck_code(dockerfile), unused.getsockname()[1]) != 0
