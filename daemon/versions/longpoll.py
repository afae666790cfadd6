"""The board: long-polls (head, current weights) wait on it; sync and publish bump it."""

import asyncio
import contextlib
from collections.abc import Callable


class Board:
    """Wakes long-polls when the chain head or the current weights change."""

    def __init__(self) -> None:
        self.cond = asyncio.Condition()

    async def wait(self, pred: Callable[[], bool], timeout: float) -> None:
        async with self.cond:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.cond.wait_for(pred), timeout)

    async def bump(self) -> None:
        async with self.cond:
            self.cond.notify_all()
