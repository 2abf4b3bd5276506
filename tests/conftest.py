"""Shared fixtures: tiny random checkpoints (built with save_pretrained) and live deployments."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import torch

# Without a GPU the Triton kernels run in Triton's CPU interpreter, which has to be chosen before anything
# (transformers, below) first imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import FIXED_K, build_checkpoint, restrict_vocabulary, train_tokenizer  # noqa: E402

from deployment.processes import Deployment, ServerProcess, free_port  # noqa: E402
from specserve.v1 import coordinator_pb2_grpc  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Llama and Qwen2 targets, unrelated random drafts, a draft with another tokenizer, and the Llama
    target restricted to its first 288 token ids (a subset-vocabulary draft that agrees with it there)."""
    root = tmp_path_factory.mktemp("checkpoints")
    tokenizer = train_tokenizer()
    other_tokenizer = train_tokenizer(vocab_size=300)
    llama = build_checkpoint(root / "llama", tokenizer, "llama", seed=0)
    return {
        "llama": llama,
        "llama_subset": restrict_vocabulary(llama, root / "llama_subset", list(range(288))),
        "llama_draft": build_checkpoint(root / "llama_draft", tokenizer, "llama", seed=1, layers=1),
        "qwen2": build_checkpoint(root / "qwen2", tokenizer, "qwen2", seed=2, heads=4, kv_heads=1),
        "qwen2_draft": build_checkpoint(root / "qwen2_draft", tokenizer, "qwen2", seed=3, layers=1, kv_heads=1),
        "mismatched_draft": build_checkpoint(root / "mismatched", other_tokenizer, "llama", seed=4, layers=1),
    }


@pytest.fixture(scope="session")
def deployments(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[Callable[..., Deployment]]:
    """Start (once per session and configuration) draft/target/coordinator processes on loopback.

    Drafts run with the confidence floor off (``tiny_models.FIXED_K``) unless ``draft_args`` says otherwise;
    ``draft_args=()`` serves the draft's defaults."""
    started: dict[tuple, Deployment] = {}
    logs = tmp_path_factory.mktemp("logs")

    def get(target: str, draft: str | None, *coordinator_args: str, model_args: tuple[str, ...] = (),
            draft_args: tuple[str, ...] = FIXED_K) -> Deployment:
        key = (target, draft, coordinator_args, model_args, draft_args)
        if key not in started:
            log_dir = logs / f"d{len(started)}"
            log_dir.mkdir()
            started[key] = Deployment(str(checkpoints[target]), str(checkpoints[draft]) if draft else None,
                                      model_args=list(model_args), coordinator_args=list(coordinator_args),
                                      draft_args=list(draft_args), log_dir=log_dir).start()
        return started[key]

    yield get
    for deployment in started.values():
        deployment.stop()


def coordinator_stub(address: str) -> coordinator_pb2_grpc.CoordinatorStub:
    """A stub on a fresh channel to the coordinator."""
    return coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(address))


@contextmanager
def target_replicas(model: Path, log_dir: Path, count: int, *coordinator_args: str,
                    target_args: Sequence[str] = ()) -> Iterator[tuple[list[ServerProcess], ServerProcess]]:
    """``count`` target replicas of ``model`` (each given ``target_args``) behind one coordinator (static
    endpoint list), stopped on exit."""
    targets = [ServerProcess("target", free_port(), ["--model", str(model), *target_args], log_dir / f"t{i}.log")
               for i in range(count)]
    coordinator = ServerProcess("coordinator", free_port(),
                                ["--target", ",".join(t.address for t in targets), *coordinator_args],
                                log_dir / "c.log")
    try:
        for server in targets:
            server.start()
        for server in targets:
            server.wait_serving()
        coordinator.start().wait_serving()
        yield targets, coordinator
    finally:
        coordinator.stop()
        for server in targets:
            server.stop()
