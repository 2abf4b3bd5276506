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


def wait_serving(address: str, service: str, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    """Block until ``service`` at ``address`` reports SERVING; raise RuntimeError on timeout or exit."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
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
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        """host:port it listens on."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        """Launch the process (stdout/stderr to log_path, or discarded)."""
        command = [sys.executable, "-m", "specserve", "serve", self.role, "--port", str(self.port), *self.args]
        output = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)
        return self

    def wait_serving(self, timeout_s: float = 180.0) -> None:
        """Block until the server reports SERVING."""
        wait_serving(self.address, SERVICE_OF_ROLE[self.role], timeout_s, self.process)

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
    model_args: Sequence[str] = ()
    coordinator_args: Sequence[str] = ()
    log_dir: Path | None = None
    servers: dict[str, ServerProcess] = field(default_factory=dict)

    def _log(self, role: str) -> Path | None:
        return self.log_dir / f"{role}.log" if self.log_dir else None

    def start(self, timeout_s: float = 300.0) -> Deployment:
        """Start the model services, wait for health, then the coordinator; returns self."""
        self.servers["target"] = ServerProcess("target", free_port(),
                                               ["--model", self.target_model, *self.model_args], self._log("target"))
        coordinator = ["--target", self.servers["target"].address, *self.coordinator_args]
        if self.draft_model:
            self.servers["draft"] = ServerProcess("draft", free_port(),
                                                  ["--model", self.draft_model, *self.model_args], self._log("draft"))
            coordinator += ["--draft", self.servers["draft"].address]
        for server in self.servers.values():
            server.start()
        for server in self.servers.values():
            server.wait_serving(timeout_s)
        self.servers["coordinator"] = ServerProcess("coordinator", free_port(), coordinator,
                                                    self._log("coordinator")).start()
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
