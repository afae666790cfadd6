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
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import ParamSpec, TypeVar

from chain.heldsetting import HeldSetting

P = ParamSpec("P")
R = TypeVar("R")


def _pause() -> bool:
    was = gc.isenabled()
    gc.disable()
    return was


_paused = HeldSetting(_pause, lambda was: gc.enable() if was else None)


def gc_paused() -> AbstractContextManager[None]:
    """The collector off until the last concurrent `gc_paused` block ends, then back to what
    it was before the first one began."""
    return _paused.held()


def without_gc(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn` run inside `gc_paused`."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with gc_paused():
            return fn(*args, **kwargs)
    return wrapper
