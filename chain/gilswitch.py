"""A writer's batches coded beside its Python, with the GIL handed over sooner.

While the writer walks and writes one batch in Python, the codec's worker thread codes the
next (chain.writer's flush). The worker takes the GIL between segments (~1 ms of coding
each); with Python's default switch interval (5 ms) it then waits up to 5 ms for a thread
running Python to let go, idle. A 1 ms interval for the span of the walk made a 50,000-tensor
publish 0.91-0.92x as long as one batch at a time, against 0.95-0.98x at 5 ms (versions
alternating in one process: docs/MEASURED.md, stop 55). The interval is the
interpreter's, so other threads switch sooner meanwhile too; it is put back when the
outermost block on any thread ends, as `chain.gcpause` does with the collector.
"""

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

SWITCH_SECONDS = 0.001
_lock = threading.Lock()
_depth = 0
_was = 0.0


@contextmanager
def quick_switches(seconds: float = SWITCH_SECONDS) -> Iterator[None]:
    """The switch interval at most `seconds` until the last concurrent block ends, then
    back to what it was before the first began."""
    global _depth, _was
    with _lock:
        if _depth == 0:
            _was = sys.getswitchinterval()
            if _was > seconds:
                sys.setswitchinterval(seconds)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                sys.setswitchinterval(_was)
