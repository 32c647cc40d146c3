"""Python work that runs on the compiling thread while a build's native threads compile.

A cold compile ends in LLVM: modules optimized and compiled on build threads, in native
code with the GIL released, while the thread that started them only waits. Work the
compile needs anyway and that does not depend on the machine code (the whole-program
cache entry's encoding and round-trip check, its load hints: ~50 ms of the small GPT
training step) can run in that wait instead of before or after it:

    task = Deferred(lambda: expensive_python())
    with meanwhile(task):
        build()              # a backend's build calls run_pending() once its threads run
    value = task.result()    # runs it here if no build did (one module, no kernels)

A task runs exactly once, on the thread that made it pending (no new Python thread, no
shared state), and its exception is raised by `result()`, never inside the build: the
build's own errors surface as before, and its threads' waits stay bounded as before.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

_local = threading.local()


class Deferred:
    """A call made at most once: by `run()` (a build's wait) or by `result()`."""

    def __init__(self, fn: Callable[[], Any]):
        self._fn = fn
        self._done = False
        self._value: Any = None
        self._error: Exception | None = None

    @property
    def done(self) -> bool:
        return self._done

    def run(self) -> None:
        """Call the function now unless it was called; keep its value or its exception."""
        if self._done:
            return
        self._done = True
        try:
            self._value = self._fn()
        except Exception as error:  # raised to the owner by result(), not into a build
            self._error = error
        self._fn = None

    def result(self) -> Any:
        """The function's value (calling it now if nothing did); its exception re-raised."""
        self.run()
        if self._error is not None:
            raise self._error
        return self._value


@contextlib.contextmanager
def meanwhile(*tasks: Deferred) -> Iterator[None]:
    """Make `tasks` pending on this thread for the duration of the block: the first build
    that waits on native threads inside it runs them (`run_pending`)."""
    previous = getattr(_local, "tasks", ())
    _local.tasks = previous + tasks
    try:
        yield
    finally:
        _local.tasks = previous


def run_pending() -> None:
    """Run this thread's pending tasks (each once). A backend calls this after starting
    native build threads and before waiting on them; a task's error is kept for its
    owner, so the build goes on to wait for (or give up on) its threads as it would."""
    tasks = getattr(_local, "tasks", ())
    _local.tasks = ()  # a task that compiles something itself finds nothing pending
    try:
        for task in tasks:
            task.run()
    finally:
        _local.tasks = tasks
