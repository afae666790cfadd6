"""The self-check's schedule (daemon/bittorrent/selfcheck.py): requested checks of single artifacts
run in
between and never postpone the scheduled pass over everything served (issue 20, finding 6).

The store and artifact component are stand-ins (this is SelfCheck's own unit test): they list
artifacts as served and have no manifests, so a pass only walks the list."""

import asyncio
import time

from daemon.bittorrent import selfcheck
from daemon.bittorrent.selfcheck import SelfCheck
from daemon.config import SelfCheckConfig

ARTIFACTS = [f"v{i:08d}.delta" for i in range(20)]


class _Swarm:
    def artifacts(self) -> list[str]:
        return list(ARTIFACTS)

    def is_complete(self, artifact: str) -> bool:
        return True


class _Artifacts:
    swarm = _Swarm()


class _Store:
    def artifacts(self) -> list[str]:
        return list(ARTIFACTS)

    def manifest(self, name: str):
        raise KeyError(name)


def test_complaints_more_often_than_the_interval_do_not_postpone_the_scheduled_pass(
        monkeypatch) -> None:
    """One complaint every 0.1 s against an interval of 1 s: the scheduled pass still runs. The
    bound is 8 s, eight intervals, for a loaded machine; the old loop restarted its wait on
    every request and never ran it."""
    monkeypatch.setattr(selfcheck, "REQUEST_GAP_S", 0.0)
    sc = SelfCheck(_Store(), _Artifacts(), SelfCheckConfig(on_start=False, interval_s=1.0),
                   peers=lambda: [])
    triggers: list[str] = []
    before_stop: list[str] = []
    real_check = sc.check

    async def check(only, trigger):
        triggers.append(trigger)
        await real_check(only, trigger)

    sc.check = check

    async def main() -> None:
        task = asyncio.create_task(sc.run())
        t0 = time.monotonic()
        i = 0
        while "schedule" not in triggers and time.monotonic() - t0 < 8.0:
            assert sc.request(ARTIFACTS[i % len(ARTIFACTS)], "complaint")
            i += 1
            await asyncio.sleep(0.1)
        before_stop.extend(triggers)
        sc.stop()
        sc.wake.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert "complaint" in before_stop
    assert "schedule" in before_stop, f"{len(before_stop)} requested checks, no scheduled pass"
