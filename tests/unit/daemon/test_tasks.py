"""Background tasks report a crash when it happens, not when shutdown finally awaits them."""

import asyncio
import logging

import pytest

from daemon.tasks import stop, watched


def test_a_crash_is_reported_at_once_with_its_name_and_traceback(caplog):
    failures: list[str] = []

    async def dies() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("libtorrent went away")

    async def main() -> None:
        task = watched(dies(), "swarm-pump", failures.append)
        for _ in range(5):
            await asyncio.sleep(0)
        assert failures == ["swarm-pump: RuntimeError: libtorrent went away"]
        await stop(task)  # the failure was reported; stopping does not raise it again

    with caplog.at_level(logging.ERROR, logger="deltaswarm.tasks"):
        asyncio.run(main())
    assert "swarm-pump" in caplog.text and "libtorrent went away" in caplog.text
    assert "Traceback" in caplog.text


@pytest.mark.parametrize("how", ["returns", "cancelled"])
def test_a_normal_return_or_a_cancel_is_not_a_failure(how):
    failures: list[str] = []

    async def part() -> None:
        if how == "returns":
            return
        await asyncio.sleep(3600)

    async def main() -> None:
        task = watched(part(), "forwarder", failures.append)
        await asyncio.sleep(0.01)
        await stop(task)

    asyncio.run(main())
    assert failures == []
