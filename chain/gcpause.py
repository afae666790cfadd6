"""Passes over tens of thousands of tensors run with Python's cyclic garbage collector paused.

A publish or an apply allocates a handful of small objects per tensor (headers, views, jobs,
manifest entries) while the objects it keeps (every entry of a 50,000-tensor manifest) pile up;
the collector then runs again and again over all of them, which took half the time of a
10,000-tensor publish and of its apply (bench/scaleout.py's tensor count). Nothing these passes
build refers to itself, so reference counting frees it all; the collector resumes when the
outermost pass on any thread ends and collects whatever cycles other code made meanwhile.
"""

import functools
import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """The collector off until the last concurrent `gc_paused` block ends, then back to what
    it was before the first one began."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


def without_gc(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn` run inside `gc_paused`."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with gc_paused():
            return fn(*args, **kwargs)
    return wrapper
