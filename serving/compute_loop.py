"""One thread for all of a model service's model work: the process's main thread, which also loads the model.

PyTorch on the CPU runs its parallel regions on an OpenMP thread team, and libgomp keeps one team per thread
that starts a parallel region. When the model is loaded on the main thread and served from another one, the
process holds two teams: more OpenMP threads than cores on a 2-core host, where libgomp then spins only 100
times before a waiting thread sleeps (its "throttled" spin count, whatever ``GOMP_SPINCOUNT`` says). Every
operator of a decode step then paid a futex wake-up: about 650 context switches per verify of the default
target, 1.2 of 2 cores busy, and a step 20-60 % slower than the same step in a one-thread process
(docs/benchmarks.md). Handing every call to the thread that loaded the model keeps a single team.
"""

from __future__ import annotations

import contextvars
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_STOP = object()


class LoopClosed(RuntimeError):
    """The service is shutting down and runs no more model work: UNAVAILABLE (retry on another replica)."""


class ComputeLoop:
    """Calls from any thread, run one at a time, in order, on the thread that runs ``serve``."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()  # put() is safe from a signal handler
        self._lock = threading.Lock()
        self._closed = False

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the serving thread in the caller's context (so the current trace span stays the
        parent) and return its result or raise its exception; blocks until it has run. Raises LoopClosed once
        ``close`` was called, and for a call still waiting then."""
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise LoopClosed("the service is shutting down")
            self._calls.put((future, contextvars.copy_context(), fn, args))
        return future.result()

    def stop(self) -> None:
        """Make ``serve`` return after the call it is running (if any); safe to call from a signal handler."""
        self._calls.put(_STOP)

    def serve(self, idle: Callable[[], None], period_s: float) -> None:
        """Run calls as they come until ``stop``; ``idle()`` runs on this thread at least every ``period_s``
        seconds, between calls (also while calls keep coming)."""
        due = time.monotonic() + period_s
        while True:
            try:
                item = self._calls.get(timeout=max(due - time.monotonic(), 0.0))
            except queue.Empty:
                item = None
            if item is _STOP:
                return
            if item is not None:
                future, context, fn, args = item
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(context.run(fn, *args))
                    except BaseException as error:  # noqa: BLE001 - the caller re-raises it
                        future.set_exception(error)
            if time.monotonic() >= due:
                idle()
                due = time.monotonic() + period_s

    def close(self) -> None:
        """Refuse further calls (LoopClosed) and fail every call still waiting with LoopClosed."""
        with self._lock:
            self._closed = True
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                item[0].set_exception(LoopClosed("the service shut down before this call ran"))
