"""Background tasks report a crash when it happens, not when shutdown finally awaits them, and
stopping one never swallows the stopper's own cancellation."""

import asyncio
import contextlib
import logging

import pytest

from daemon.tasks import stop, watched, within


async def test_a_crash_is_reported_at_once_with_its_name_and_traceback(caplog):
    failures: list[str] = []

    async def dies() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("libtorrent went away")

    with caplog.at_level(logging.ERROR, logger="deltaswarm.tasks"):
        task = watched(dies(), "swarm-pump", failures.append)
        for _ in range(5):
            await asyncio.sleep(0)
        assert failures == ["swarm-pump: RuntimeError: libtorrent went away"]
        await stop(task)  # the failure was reported; stopping does not raise it again
    assert "swarm-pump" in caplog.text and "libtorrent went away" in caplog.text
    assert "Traceback" in caplog.text


@pytest.mark.parametrize("how", ["returns", "cancelled"])
async def test_a_normal_return_or_a_cancel_is_not_a_failure(how):
    failures: list[str] = []

    async def part() -> None:
        if how == "returns":
            return
        await asyncio.sleep(3600)

    task = watched(part(), "forwarder", failures.append)
    await asyncio.sleep(0.01)
    await stop(task)
    assert task.done() and failures == []


async def test_stop_waits_for_the_task_to_finish_its_cleanup():
    cleaned: list[str] = []

    async def part() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.05)
            cleaned.append("saved resume data")

    task = asyncio.create_task(part())
    await asyncio.sleep(0)
    await stop(task)
    assert cleaned == ["saved resume data"] and task.cancelled()


async def test_a_stop_cut_short_by_a_deadline_raises_at_the_deadline():
    """serve() bounds shutdown with a timeout around cleanups that call stop(); a part slow to
    wind down must not make stop() eat the timeout's cancellation and report a clean stop."""
    loop = asyncio.get_running_loop()
    release = loop.time() + 2.0  # far past the 0.1 s asked

    async def stubborn() -> None:
        while loop.time() < release:  # ignores cancellation until `release`
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(release - loop.time())

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    started = loop.time()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(stop(task), 0.1)
    assert loop.time() - started < 1.5
    await asyncio.wait({task})  # let it end before the loop closes


async def test_within_returns_at_the_deadline_even_if_the_work_ignores_cancellation():
    loop = asyncio.get_running_loop()
    release = loop.time() + 2.0  # far past the 0.1 s asked
    finished: list[bool] = []

    async def slow_cleanup() -> None:
        while loop.time() < release:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(release - loop.time())
        finished.append(True)

    started = loop.time()
    assert await within(slow_cleanup(), 0.1) is False
    assert loop.time() - started < 1.5 and finished == []
    assert await within(asyncio.sleep(0.01), 1.0) is True
    with pytest.raises(RuntimeError, match="disk"):
        await within(_raises("disk full"), 1.0)
    await asyncio.sleep(release - loop.time() + 0.05)  # let the abandoned one end


async def _raises(message: str) -> None:
    raise RuntimeError(message)
