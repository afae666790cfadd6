"""Syncer.run keeps a head announced during a step (issue 19, item 4): the wake-up is cleared
before each step, so a version published while the previous one downloads or applies starts
the next step at once. It used to be cleared after the step, which dropped that announcement
and left the next version waiting for the loop's 1 s retry timer."""

import asyncio

from daemon.versions.sync import Syncer


class _Wake(asyncio.Event):
    """Records whether the event was still set each time the loop starts waiting on it."""

    def __init__(self) -> None:
        super().__init__()
        self.set_at_wait: list[bool] = []

    async def wait(self) -> bool:
        self.set_at_wait.append(self.is_set())
        return await super().wait()


async def test_a_head_announced_during_a_step_is_not_lost() -> None:
    s = Syncer.__new__(Syncer)  # only what run() touches
    s.stopping, s.last_error, s.wake = False, "", _Wake()
    steps = []

    async def step() -> int | None:
        steps.append(len(steps))
        if len(steps) == 1:
            s.wake.set()  # the head watcher hears v+1 while v is being applied
        else:
            s.stopping = True
        return None

    s.step = step
    await asyncio.wait_for(s.run(), 10)
    assert steps == [0, 1]
    assert s.wake.set_at_wait[0], "the announcement made during the step was dropped"
