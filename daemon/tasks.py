"""Background tasks that must not die quietly.

asyncio keeps a task's exception until someone awaits the task, which for a daemon's forever
loops (swarm pump, sync, forwarder, ...) is only at shutdown: the node would limp on with a part
missing and systemd would see nothing wrong. `watched()` logs the traceback the moment a task
dies and calls `on_failure`, which stops the daemon with a failing exit status so the service
manager restarts it. A task that returns normally (a part with nothing to do) is not a failure.
"""

import asyncio
import logging
from collections.abc import Callable, Coroutine

log = logging.getLogger("deltaswarm.tasks")


def watched(coro: Coroutine, name: str, on_failure: Callable[[str], None]) -> asyncio.Task:
    """Start `coro` as a task named `name`; a crash is logged and reported at once."""
    task = asyncio.create_task(coro, name=name)

    def done(t: asyncio.Task) -> None:
        if t.cancelled():
            return
        exc = t.exception()
        if exc is not None:
            log.error("background task %r died; stopping the daemon so it is restarted",
                      name, exc_info=exc)
            on_failure(f"{name}: {type(exc).__name__}: {exc}")

    task.add_done_callback(done)
    return task


async def stop(task: asyncio.Task) -> None:
    """Cancel `task` and wait until it has finished; a failure it already reported is not raised
    again. The caller's own cancellation (a shutdown deadline running out) is never swallowed: it
    is raised at once, even while `task` is still winding down, so a bounded stop stays bounded.
    """
    task.cancel()
    await asyncio.wait({task})  # unlike `await task`, a cancel of the caller does not wait
    if not task.cancelled():
        task.exception()  # reported by `watched` (or deliberately ignored); marks it retrieved


async def within(coro: Coroutine, timeout: float, name: str = "shutdown") -> bool:
    """Run `coro` as a task for at most `timeout` seconds: True if it finished (its exception
    raised), False if time ran out, in which case it is cancelled but NOT awaited. Unlike
    `asyncio.wait_for`, which waits for the cancelled work to wind down (aiohttp's cleanup runs
    every remaining cleanup context first), this returns at the deadline; the caller then exits
    the process without the event loop's teardown, which would wait again."""
    task = asyncio.create_task(coro, name=name)
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        task.cancel()
        return False
    task.result()
    return True
