"""Failures of a distributed deployment, with real processes: killed services, cancelled clients,
full queues and KV budgets."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from conftest import coordinator_stub, target_replicas
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hf_oracle import greedy
from prometheus_scrape import scrape, value
from tiny_models import FIXED_K

from bench.synthetic import LlamaShape, save_synthetic_llama
from deployment.processes import Deployment, ServerProcess, free_port
from engine.batch import GroupInput
from engine.checkpoint import load_checkpoint
from engine.sampling import SamplingParams
from engine.target import TargetRuntime
from specserve.v1 import coordinator_pb2, model_pb2, model_pb2_grpc

PROMPT = [7, 21, 9, 30, 11]


def long_request(n: int = 3, max_new: int = 300) -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(prompt_token_ids=PROMPT, n=n, max_new_tokens=max_new, ignore_eos=True)


def restart(server: ServerProcess) -> None:
    server.start()
    server.wait_serving()


def stats(server: ServerProcess) -> model_pb2.ModelStats:
    stub_class = model_pb2_grpc.DraftModelStub if server.role == "draft" else model_pb2_grpc.TargetModelStub
    return stub_class(grpc.insecure_channel(server.address)).Stats(model_pb2.StatsRequest(), timeout=10)


def wait_released(deployment: Deployment, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held = [stats(deployment.servers[r]) for r in ("draft", "target")]
        if all(s.sequences == 0 and s.batches == 0 for s in held):
            return
        time.sleep(0.2)
    pytest.fail(f"sessions not released: {held}")


@pytest.fixture
def deployment(checkpoints, tmp_path):
    with Deployment(str(checkpoints["llama"]), str(checkpoints["llama"]), log_dir=tmp_path,
                    draft_args=FIXED_K) as running:
        yield running


def test_draft_killed_mid_generation_then_rejoins(deployment, checkpoints):
    stub = coordinator_stub(deployment.coordinator_address)
    expected = greedy(checkpoints["llama"], PROMPT, 300, None)
    stream = stub.GenerateStream(long_request(), timeout=300)
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for number, chunk in enumerate(stream):
        if number == 3:
            deployment.servers["draft"].stop(signal.SIGKILL)
        tokens[chunk.index] += chunk.token_ids
    assert all(t == expected for t in tokens.values())
    restart(deployment.servers["draft"])
    deadline = time.monotonic() + 60
    while True:  # the coordinator re-joins the draft mid-batch, which must catch up without changing output
        response = stub.Generate(long_request(), timeout=300)
        assert all(list(c.token_ids) == expected for c in response.completions)
        if response.usage.draft_tokens_proposed > 0 or time.monotonic() > deadline:
            break
    assert response.usage.draft_tokens_proposed > 0, "the coordinator never returned to speculation"


def test_target_killed_fails_running_request_and_serves_again(deployment):
    stub = coordinator_stub(deployment.coordinator_address)
    stream = stub.GenerateStream(long_request(max_new=400), timeout=300)
    with pytest.raises(grpc.RpcError) as raised:
        for number, _ in enumerate(stream):
            if number == 2:
                deployment.servers["target"].stop(signal.SIGKILL)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "target replica" in raised.value.details()
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(deployment.coordinator_address))
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    # A request sent while the target is down waits in the queue and is served once it is back.
    results: list = []
    waiter = threading.Thread(target=lambda: results.append(stub.Generate(long_request(n=2, max_new=16),
                                                                          timeout=300)))
    waiter.start()
    time.sleep(1.0)
    restart(deployment.servers["target"])
    waiter.join(300)
    assert [len(c.token_ids) for c in results[0].completions] == [16, 16]


def test_cancelled_stream_and_deadline_release_sessions(deployment):
    stub = coordinator_stub(deployment.coordinator_address)
    stream = stub.GenerateStream(long_request(n=4, max_new=450), timeout=300)
    next(stream)
    next(stream)
    stream.cancel()
    wait_released(deployment)
    # sampled: the tiny random model's greedy output repeats itself, which prompt lookup would finish in time
    request = long_request(n=4, max_new=450)
    request.temperature = 1.0
    with pytest.raises(grpc.RpcError) as raised:
        stub.Generate(request, timeout=0.5)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_released(deployment)


def test_a_stream_cancelled_at_any_chunk_stops_its_sequences_at_once(deployment):
    """However the client's cancel meets the handler (waiting for the next chunk, or sending one, which closes
    the handler's generator without a CancelledError), the request's sequences leave the batch within a round
    or two, long before its 480 sampled tokens could finish (seconds on a CPU)."""
    stub = coordinator_stub(deployment.coordinator_address)
    for chunks in (1, 3, 6, 10, 15):
        request = long_request(n=16, max_new=480)
        request.temperature = 1.0
        stream = stub.GenerateStream(request, timeout=300)
        for _ in range(chunks):
            next(stream)
        stream.cancel()
        wait_released(deployment, timeout_s=2.0)


def test_full_queue_answers_resource_exhausted(checkpoints, tmp_path):
    bounds = ["--max-queue", "1", "--max-batch-sequences", "1"]
    with Deployment(str(checkpoints["llama"]), None, coordinator_args=bounds, log_dir=tmp_path) as deployment:
        stub = coordinator_stub(deployment.coordinator_address)
        futures = [stub.Generate.future(long_request(n=1, max_new=200), timeout=300) for _ in range(6)]
        codes = []
        for future in futures:
            try:
                future.result()
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as error:
                codes.append(error.code())
                assert "retry" in error.details()
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
        assert codes.count(grpc.StatusCode.OK) >= 2


def test_kv_budget_refuses_new_groups(checkpoints, tmp_path):
    with Deployment(str(checkpoints["llama"]), str(checkpoints["llama_draft"]), model_args=["--kv-budget-mb", "0.1"],
                    log_dir=tmp_path) as deployment:
        stub = coordinator_stub(deployment.coordinator_address)
        with pytest.raises(grpc.RpcError) as raised:
            stub.Generate(long_request(n=8, max_new=64), timeout=60)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "KV cache budget" in raised.value.details()
        small = stub.Generate(long_request(n=1, max_new=8), timeout=60)
        assert len(small.completions[0].token_ids) == 8


def test_sigterm_drains_and_exits_cleanly(deployment):
    stub = coordinator_stub(deployment.coordinator_address)
    assert len(stub.Generate(long_request(n=1, max_new=4), timeout=60).completions) == 1
    for role in ("coordinator", "draft", "target"):
        process = deployment.servers[role].process
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, f"{role} did not exit cleanly on SIGTERM"


def test_request_retried_on_another_target_replica(checkpoints, tmp_path):
    """A target replica killed mid-request: a unary request (nothing streamed yet) finishes on the other
    replica with the same greedy output."""
    with target_replicas(checkpoints["llama"], tmp_path, 2) as (targets, coordinator):
        stub = coordinator_stub(coordinator.address)
        future = stub.Generate.future(long_request(n=2, max_new=450), timeout=300)
        deadline = time.monotonic() + 30
        busy = None
        while busy is None and time.monotonic() < deadline:
            busy = next((t for t in targets if stats(t).sequences > 0), None)
        assert busy is not None, "the request never reached a replica"
        busy.stop(signal.SIGKILL)
        response = future.result()
        expected = greedy(checkpoints["llama"], PROMPT, 450, None)
        assert [list(c.token_ids) for c in response.completions] == [expected, expected]


def test_prefix_cache_over_grpc_hits_stays_exact_and_unpins_on_cancel(checkpoints, tmp_path):
    """Both services with their default prefix cache (on, no flag given): a second request with the same
    long prompt is served from the cache (Stats and the response's Usage count the hit tokens) with
    HF-greedy output, and a cancelled stream leaves no reference."""
    prompt = list(range(40, 80))  # 40 tokens: two 16-token blocks can be cached
    request = coordinator_pb2.GenerateRequest(prompt_token_ids=prompt, n=3, max_new_tokens=12, ignore_eos=True)
    with Deployment(str(checkpoints["llama"]), str(checkpoints["llama_draft"]), log_dir=tmp_path,
                    metrics=True) as running:
        stub = coordinator_stub(running.coordinator_address)
        expected = greedy(checkpoints["llama"], prompt, 12, None)
        for cached in (0, 32):
            response = stub.Generate(request, timeout=300)
            assert [list(c.token_ids) for c in response.completions] == [expected] * 3
            assert response.usage.cached_prompt_tokens == cached and response.usage.prompt_tokens == 40
        for role in ("draft", "target"):
            held = stats(running.servers[role])
            assert held.prefix_cache_hit_tokens == 32 and held.prefix_cache_lookup_tokens == 80
            assert held.prefix_cache_bytes > 0 and held.prefix_cache_spans == 1
            metrics = scrape(running.servers[role].metrics_port)  # Prometheus: the same bytes and hit rate
            assert value(metrics, "specserve_prefix_cache_bytes") == held.prefix_cache_bytes, role
            assert value(metrics, "specserve_prefix_cache_hit_rate") == pytest.approx(32 / 80), role
        coordinator = scrape(running.servers["coordinator"].metrics_port)
        assert value(coordinator, "specserve_cached_prompt_tokens_total") == 32
        assert value(coordinator, "specserve_prompt_tokens_total") == 80
        stream = stub.GenerateStream(coordinator_pb2.GenerateRequest(prompt_token_ids=prompt, n=4,
                                                                     max_new_tokens=400, ignore_eos=True),
                                     timeout=300)
        next(stream)
        assert stats(running.servers["target"]).prefix_cache_refs == 1
        stream.cancel()
        wait_released(running)
        assert all(stats(running.servers[r]).prefix_cache_refs == 0 for r in ("draft", "target"))


def test_interleaved_system_prompts_through_the_services_stay_exact(checkpoints, tmp_path):
    """Requests with two system prompts join one running batch interleaved (S1, S2, S1): both services put
    the second S1 group next to the first (a row order the coordinator never sees, everything is keyed by
    sequence id), and every request gets HF-greedy output."""
    first, second = list(range(40, 72)), list(range(100, 132))  # two 32-token system prompts
    prompts = [first + [5, 6, 7], second + [8], first + [9, 10]]

    def request(prompt: list[int], max_new: int) -> coordinator_pb2.GenerateRequest:
        return coordinator_pb2.GenerateRequest(prompt_token_ids=prompt, n=2, max_new_tokens=max_new, ignore_eos=True)

    with Deployment(str(checkpoints["llama"]), str(checkpoints["llama_draft"]), log_dir=tmp_path) as running:
        stub = coordinator_stub(running.coordinator_address)
        stream = stub.GenerateStream(request(prompts[0], 400), timeout=300)
        chunks = [next(stream)]  # the S1 request is running
        joined = [stub.Generate.future(request(prompt, 12), timeout=300) for prompt in prompts[1:]]
        responses = [future.result() for future in joined]
        stream.cancel()  # it is still running (cancelled, not finished, below): the others shared its batch;
        # what it streamed before (buffered chunks are dropped by the cancel) is HF greedy
        with pytest.raises(grpc.RpcError) as cancelled:
            chunks.extend(stream)
        assert cancelled.value.code() == grpc.StatusCode.CANCELLED
    streamed: dict[int, list[int]] = {}
    for chunk in chunks:
        streamed.setdefault(chunk.index, []).extend(chunk.token_ids)
    expected = greedy(checkpoints["llama"], prompts[0], 400, None)
    assert streamed and all(0 < len(tokens) < 400 and tokens == expected[:len(tokens)] for tokens in streamed.values())
    for prompt, response in zip(prompts[1:], responses, strict=True):
        assert [list(c.token_ids) for c in response.completions] == [greedy(checkpoints["llama"], prompt, 12, None)] * 2
    assert [r.usage.cached_prompt_tokens for r in responses] == [0, 32]


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory):
    """A synthetic Llama (hidden 512, 4 layers) whose 4K-token prefill takes seconds on a CPU."""
    return save_synthetic_llama(tmp_path_factory.mktemp("slow") / "model", LlamaShape(max_positions=8192))


def slow_prompt(seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 40000 + 100 for i in range(4096)]


def test_a_prefill_whose_caller_gave_up_leaves_nothing_behind(slow_model, tmp_path):
    """A Prefill that outlives its deadline, running or still queued behind another, keeps no sequence: the
    same ids can be prefilled again, and only the prefill whose caller waited is held."""
    server = ServerProcess("target", free_port(), ["--model", str(slow_model)], tmp_path / "target.log").start()
    try:
        server.wait_serving()
        stub = model_pb2_grpc.TargetModelStub(grpc.insecure_channel(server.address))

        def prefill(group: int, timeout: float, tokens: list[int]) -> model_pb2.PrefillResponse:
            spec = model_pb2.GroupSpec(group_id=group, prompt_token_ids=tokens, sequence_ids=[group],
                                       max_new_tokens=4, sampling=model_pb2.SamplingParams(top_p=1.0))
            return stub.Prefill(model_pb2.PrefillRequest(batch_id="b", groups=[spec]), timeout=timeout)

        with pytest.raises(grpc.RpcError) as raised:  # gives up while its prefill runs
            prefill(1, 0.3, slow_prompt(1))
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        waited = threading.Thread(target=prefill, args=(2, 120.0, slow_prompt(2)))
        waited.start()
        time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as raised:  # gives up while queued behind group 2
            prefill(3, 0.3, slow_prompt(3))
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        waited.join()
        for group in (1, 3):  # not "already live": nothing of the abandoned prefills was kept
            assert len(prefill(group, 120.0, [5, 6, 7]).first_tokens) == 1
        assert stats(server).sequences == 3
    finally:
        server.stop()


def test_sigterm_lets_the_model_calls_in_flight_finish(slow_model, tmp_path):
    """SIGTERM while a long prefill runs on the model thread, and a short prefill that arrives after the signal
    but before the long one is done (the server still accepts calls until then): both answer OK, since the
    service keeps running model calls while it drains, and the process exits cleanly."""
    server = ServerProcess("target", free_port(), ["--model", str(slow_model)], tmp_path / "target.log").start()
    try:
        server.wait_serving()
        stub = model_pb2_grpc.TargetModelStub(grpc.insecure_channel(server.address))

        def prefill(group: int, tokens: list[int]) -> grpc.Future:
            spec = model_pb2.GroupSpec(group_id=group, prompt_token_ids=tokens, sequence_ids=[group],
                                       max_new_tokens=4, sampling=model_pb2.SamplingParams(top_p=1.0))
            return stub.Prefill.future(model_pb2.PrefillRequest(batch_id="b", groups=[spec]), timeout=120)

        running = prefill(0, slow_prompt(5))
        time.sleep(0.3)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        waiting = prefill(1, [5, 6, 7])
        time.sleep(0.1)
        assert not running.done(), "the long prefill ended too soon: the test needs a slower one"
        assert len(running.result().first_tokens) == 1
        assert len(waiting.result().first_tokens) == 1
        assert server.process.wait(30) == 0
    finally:
        server.stop()


def test_prefills_that_time_out_at_the_coordinator_are_retried_without_failing_the_batch(slow_model, tmp_path):
    """Concurrent long prompts queue on the target's compute thread past --model-timeout: the timed-out
    prefills are released on the target and retried, and every request completes. The timeout is twice one
    prefill as measured here, so the fourth queued prefill times out; each retry waits twice as long as the
    try before, so the requests complete even where the service's prefills are slower than this probe."""
    runtime = TargetRuntime(load_checkpoint(slow_model))
    start = time.perf_counter()
    runtime.prefill("probe", [GroupInput(0, slow_prompt(9), [0, 1], SamplingParams(), 4)])
    timeout = 2 * (time.perf_counter() - start)
    with Deployment(str(slow_model), None, coordinator_args=["--model-timeout", f"{timeout:.2f}"],
                    log_dir=tmp_path) as running:
        stub = coordinator_stub(running.coordinator_address)
        requests = [coordinator_pb2.GenerateRequest(prompt_token_ids=slow_prompt(i), n=2, max_new_tokens=4,
                                                    ignore_eos=True) for i in range(4)]
        results: list[object] = [None] * len(requests)

        def send(index: int) -> None:
            try:
                results[index] = stub.Generate(requests[index], timeout=300)
            except grpc.RpcError as error:
                results[index] = error

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert all(isinstance(r, coordinator_pb2.GenerateResponse) for r in results), results
        assert all(len(c.token_ids) == 4 for r in results for c in r.completions)
        assert "failed a prefill (DEADLINE_EXCEEDED)" in (tmp_path / "coordinator.log").read_text()


def test_a_model_timeout_shorter_than_one_prefill_fails_the_request_naming_the_flag(slow_model, tmp_path):
    """--model-timeout far below one prefill (every try times out, even doubled): the request fails with
    DEADLINE_EXCEEDED naming the flag instead of retrying until the client's deadline, and the target keeps
    none of its sequences. The prefix cache is off: with it, a timed-out try still caches the prompt and the
    retry's prefill is one position (it then fails its first step instead)."""
    with Deployment(str(slow_model), None, coordinator_args=["--model-timeout", "0.02"],
                    model_args=["--prefix-cache-mb", "0"], log_dir=tmp_path) as running:
        stub = coordinator_stub(running.coordinator_address)
        request = coordinator_pb2.GenerateRequest(prompt_token_ids=slow_prompt(1), n=2, max_new_tokens=4)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as raised:
            stub.Generate(request, timeout=300)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "4096-token prompt in 4 tries" in raised.value.details()
        assert "--model-timeout (0.02s, doubled on each retry)" in raised.value.details()
        assert time.monotonic() - started < 120
        deadline = time.monotonic() + 30
        while stats(running.servers["target"]).sequences and time.monotonic() < deadline:
            time.sleep(0.2)
        assert stats(running.servers["target"]).sequences == 0
