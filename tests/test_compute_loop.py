"""The model services' compute loop: every call runs on the serving thread, in order, with the caller's
context; the janitor runs between calls; stop works from a signal handler; close fails what still waits."""

from __future__ import annotations

import contextvars
import os
import signal
import threading
import time

import pytest

from serving.compute_loop import ComputeLoop, LoopClosed

caller = contextvars.ContextVar("caller", default="none")


def serving_in_background(loop: ComputeLoop, idle=lambda: None, period_s: float = 60.0) -> threading.Thread:
    thread = threading.Thread(target=loop.serve, args=(idle, period_s), daemon=True)
    thread.start()
    return thread


def test_calls_from_many_threads_run_on_the_serving_thread_in_the_callers_context():
    loop = ComputeLoop()
    server = serving_in_background(loop)
    results: dict[int, tuple[int, str, int]] = {}

    def client(index: int) -> None:
        caller.set(f"client {index}")
        results[index] = loop.call(lambda x: (threading.get_ident(), caller.get(), x * x), index)

    clients = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join()
    assert results == {i: (server.ident, f"client {i}", i * i) for i in range(8)}
    with pytest.raises(ZeroDivisionError):  # the caller gets the call's own exception
        loop.call(lambda: 1 / 0)
    assert loop.call(len, [1, 2, 3]) == 3  # and the loop still serves
    loop.stop()
    server.join(5)
    assert not server.is_alive()


def test_calls_run_one_at_a_time_in_the_order_they_came():
    loop = ComputeLoop()
    server = serving_in_background(loop)
    running, order = [], []

    def work(index: int) -> None:
        running.append(index)
        assert len(running) == 1, running
        time.sleep(0.01)
        order.append(index)
        running.remove(index)

    for index in range(5):
        loop.call(work, index)
    threads = [threading.Thread(target=loop.call, args=(work, 10 + i)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert order[:5] == [0, 1, 2, 3, 4] and sorted(order[5:]) == list(range(10, 16))
    loop.stop()
    server.join(5)


def test_the_idle_work_runs_on_time_even_while_calls_keep_coming():
    loop = ComputeLoop()
    idle_threads: list[int] = []
    server = serving_in_background(loop, lambda: idle_threads.append(threading.get_ident()), 0.05)
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:  # never a gap of 0.05 s between calls
        loop.call(time.sleep, 0.01)
    loop.stop()
    server.join(5)
    assert len(idle_threads) >= 6, idle_threads  # about 12 periods passed
    assert set(idle_threads) == {server.ident}


def test_stop_from_a_signal_handler_ends_serve_on_the_main_thread():
    loop = ComputeLoop()
    previous = signal.signal(signal.SIGUSR1, lambda *_: loop.stop())
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        start = time.monotonic()
        loop.serve(lambda: None, 60.0)  # returns once the handler ran, long before the idle period
        assert time.monotonic() - start < 10
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_close_fails_waiting_calls_and_refuses_new_ones():
    loop = ComputeLoop()  # nobody serves it: a call waits
    outcome: list[BaseException] = []

    def waiting() -> None:
        try:
            loop.call(lambda: "ran")
        except LoopClosed as error:
            outcome.append(error)

    thread = threading.Thread(target=waiting)
    thread.start()
    time.sleep(0.1)
    loop.close()
    thread.join(5)
    assert not thread.is_alive() and "shut down before this call ran" in str(outcome[0])
    with pytest.raises(LoopClosed, match="shutting down"):
        loop.call(lambda: "ran")
