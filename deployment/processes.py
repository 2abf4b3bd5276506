"""Running specserve servers as child processes on loopback (demo, tests, benchmarks)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.grpc_server import open_channel
from serving.tls import TLSFiles

SERVICE_OF_ROLE = {
    "draft": "specserve.v1.DraftModel",
    "target": "specserve.v1.TargetModel",
    "coordinator": "specserve.v1.Coordinator",
}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_serving(address: str, service: str, timeout_s: float, process: subprocess.Popen | None = None,
                 tls: TLSFiles | None = None) -> None:
    """Block until ``service`` at ``address`` reports SERVING; raise RuntimeError on timeout or exit."""
    deadline = time.monotonic() + timeout_s
    with open_channel(address, tls or TLSFiles()) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{service} at {address} exited with status {process.returncode}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise RuntimeError(f"{service} at {address} not serving after {timeout_s:.0f}s")


@dataclass
class ServerProcess:
    """One ``specserve serve ROLE`` child process."""

    role: str
    port: int
    args: list[str]
    log_path: Path | None = None
    tls: TLSFiles = field(default_factory=TLSFiles)
    env: dict[str, str] | None = None  # extra environment variables (e.g. OTEL_*) of the process
    metrics_port: int = 0  # --metrics-port of the server (0 = off)
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        """host:port it listens on."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        """Launch the process (stdout/stderr to log_path, or discarded)."""
        command = [sys.executable, "-m", "specserve", "serve", self.role, "--port", str(self.port), *self.args]
        for flag, path in (("--tls-cert", self.tls.cert), ("--tls-key", self.tls.key), ("--tls-ca", self.tls.ca)):
            if path:
                command += [flag, path]
        if self.tls.client_auth:
            command.append("--tls-client-auth")
        if self.metrics_port:
            command += ["--metrics-port", str(self.metrics_port)]
        output = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        # Processes sharing the machine's cores: OpenMP threads spin only briefly after a parallel region
        # (long spinning steals the cores another service needs; no spinning pays a wake-up per op).
        env = {"GOMP_SPINCOUNT": "20000", **os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        self.process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)
        return self

    def wait_serving(self, timeout_s: float = 180.0) -> None:
        """Block until the server reports SERVING."""
        wait_serving(self.address, SERVICE_OF_ROLE[self.role], timeout_s, self.process, self.tls)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        """Stop the process (SIGKILL when it does not exit in time)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(sig)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass
class Deployment:
    """Draft (optional), target and coordinator processes on free loopback ports."""

    target_model: str
    draft_model: str | None
    model_args: Sequence[str] = ()  # flags of both model services
    coordinator_args: Sequence[str] = ()
    draft_args: Sequence[str] = ()  # flags of the draft service only
    log_dir: Path | None = None
    tls: TLSFiles = field(default_factory=TLSFiles)
    env: dict[str, str] | None = None  # extra environment variables of every server (e.g. OTEL_*)
    metrics: bool = False  # give every server a free --metrics-port (ServerProcess.metrics_port)
    servers: dict[str, ServerProcess] = field(default_factory=dict)

    def _log(self, role: str) -> Path | None:
        return self.log_dir / f"{role}.log" if self.log_dir else None

    def _configure(self, server: ServerProcess) -> ServerProcess:
        server.env = self.env
        if self.metrics and not server.metrics_port:
            server.metrics_port = free_port()
        return server

    def start(self, timeout_s: float = 300.0) -> Deployment:
        """Start the model services, wait for health, then the coordinator; returns self."""
        self.servers["target"] = ServerProcess("target", free_port(),
                                               ["--model", self.target_model, *self.model_args], self._log("target"),
                                               self.tls)
        coordinator = ["--target", self.servers["target"].address, *self.coordinator_args]
        if self.draft_model:
            self.servers["draft"] = ServerProcess("draft", free_port(),
                                                  ["--model", self.draft_model, *self.model_args, *self.draft_args],
                                                  self._log("draft"),
                                                  self.tls)
            coordinator += ["--draft", self.servers["draft"].address]
        for server in self.servers.values():
            self._configure(server).start()
        for server in self.servers.values():
            server.wait_serving(timeout_s)
        self.servers["coordinator"] = self._configure(ServerProcess("coordinator", free_port(), coordinator,
                                                                    self._log("coordinator"), self.tls)).start()
        self.servers["coordinator"].wait_serving(timeout_s)
        return self

    @property
    def coordinator_address(self) -> str:
        """host:port of the public API."""
        return self.servers["coordinator"].address

    def stop(self) -> None:
        """Stop every process, coordinator first."""
        for role in ("coordinator", "draft", "target"):
            if role in self.servers:
                self.servers[role].stop()

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
