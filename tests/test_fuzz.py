"""Random GenerateRequests against a live server: it never crashes and always answers with a status."""

from __future__ import annotations

import grpc
from conftest import coordinator_stub
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve.v1 import coordinator_pb2

ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}

int32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)

requests = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.text(max_size=40),
        "prompt_token_ids": st.lists(st.one_of(st.integers(-3, 400), int32), max_size=30),
        "n": st.one_of(st.integers(-2, 70), int32),
        "max_new_tokens": st.one_of(st.integers(-2, 24), int32),
        "temperature": st.one_of(st.floats(0, 2, width=32), floats),
        "top_p": st.one_of(st.floats(0, 1.25, width=32), floats),
        "top_k": st.one_of(st.integers(-2, 50), int32),
        "seed": st.integers(0, 2**64 - 1),
        "stop": st.lists(st.text(max_size=4), max_size=18),
        "ignore_eos": st.booleans(),
    },
)


def test_random_requests_always_get_a_status(deployments):
    stub = coordinator_stub(deployments("llama", "llama_draft").coordinator_address)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(requests)
    def check(fields):
        request = coordinator_pb2.GenerateRequest(**fields)
        try:
            response = stub.Generate(request, timeout=120)
            code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            code = error.code()
            assert error.details(), "a status without a message"
        assert code in ANSWERS, code
        if code == grpc.StatusCode.OK:
            assert len(response.completions) == (request.n if request.HasField("n") else 1)

    check()
    ok = stub.Generate(coordinator_pb2.GenerateRequest(prompt_token_ids=[4, 5], n=2, max_new_tokens=4,
                                                       ignore_eos=True), timeout=60)
    assert [len(c.token_ids) for c in ok.completions] == [4, 4]
