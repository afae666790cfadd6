"""A writer's batches coded beside its Python, with the GIL handed over sooner.

While the writer walks and writes one batch in Python, the codec's worker thread codes the
next (chain.writer's flush). The worker takes the GIL between segments (~1 ms of coding
each); with Python's default switch interval (5 ms) it then waits up to 5 ms for a thread
running Python to let go, idle. A 1 ms interval for the span of the walk made a 50,000-tensor
publish 0.91-0.95x as long as one batch at a time, against 0.95-0.98x at 5 ms (versions
alternating in one process: docs/MEASURED.md, stop 55). The interval is the
interpreter's, so other threads switch sooner meanwhile too; it is put back when the
outermost block on any thread ends (chain.heldsetting), as the collector is by
`chain.gcpause`.
"""

import sys
from contextlib import AbstractContextManager

from chain.heldsetting import HeldSetting

SWITCH_SECONDS = 0.001


def _shorten() -> float:
    was = sys.getswitchinterval()
    sys.setswitchinterval(min(was, SWITCH_SECONDS))
    return was


_quick = HeldSetting(_shorten, sys.setswitchinterval)


def quick_switches() -> AbstractContextManager[None]:
    """The switch interval at most SWITCH_SECONDS until the last concurrent block ends, then
    back to what it was before the first began."""
    return _quick.held()
