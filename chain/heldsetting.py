"""A process-wide setting changed while any of several concurrent blocks runs.

Passes over tens of thousands of tensors change interpreter-wide state for their span (the
cyclic collector paused, `chain.gcpause`; a shorter GIL switch interval, `chain.gilswitch`).
Two such passes may overlap on different threads: the first to begin saves the setting and
changes it, the last to end puts back what the first saved, so neither undoes the other's
change midway.
"""

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class HeldSetting(Generic[T]):
    """`change()` (returning what to restore) when the first `held` block begins,
    `restore(saved)` when the last concurrent one ends."""

    def __init__(self, change: Callable[[], T], restore: Callable[[T], None]) -> None:
        self._change, self._restore = change, restore
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: T | None = None

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._saved = self._change()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._restore(self._saved)  # type: ignore[arg-type]
