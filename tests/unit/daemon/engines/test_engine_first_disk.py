"""The disk catch-up waits (bounded) for the engines that follow the region to serve the newest
verified version first: run alongside an engine's patch it slowed that version's serving."""

import time
from pathlib import Path

from chain.patchfile import Patch
from chain.weights import WeightsDir
from daemon.engines.first import EngineFirst, Pending


def _first(tmp_path: Path, versions: int) -> EngineFirst:
    ef = EngineFirst(WeightsDir(tmp_path / "weights"), tmp_path / "patches", lambda b: b"",
                     batch=2, idle_s=60.0)
    for v in range(1, versions + 1):
        ef._phase(v)
        ef.pending.append(Pending(None, Patch(v, v - 1, "p", "s", []),  # type: ignore[arg-type]
                                  tmp_path / f"v{v}.patch"))
        ef.last_verified = time.monotonic()
    return ef


def test_a_due_batch_waits_for_a_following_engine_until_it_serves(tmp_path: Path) -> None:
    ef = _first(tmp_path, 2)
    assert ef.due()  # no engine has ever said it follows this region: the batch goes
    ef.served("w1", 1, "patch")
    assert not ef.due() and 0 < ef._engines_behind() <= EngineFirst.ENGINES_FIRST_S
    assert ef.wake.is_set()  # served() wakes the disk loop to look again
    ef.served("hook:vllm", 2, "patch")
    assert not ef.due()  # w1 has not served v2 yet
    ef.served("w1", 2, "patch")
    assert ef.due()


def test_an_engine_that_never_serves_holds_the_disk_back_only_a_bounded_time(
        tmp_path: Path) -> None:
    ef = _first(tmp_path, 2)
    ef.served("w1", 1, "patch")
    assert not ef.due()
    # new versions keep arriving faster than w1 follows: the wait still ends, counted from
    # when the pass fell due, not from the newest version
    ef.pending.append(Pending(None, Patch(3, 2, "p", "s", []),  # type: ignore[arg-type]
                              tmp_path / "v3.patch"))
    ef._phase(3)
    assert not ef.due()
    ef.held_since = time.monotonic() - EngineFirst.ENGINES_FIRST_S - 0.1
    assert ef._engines_behind() is None and ef.due()
    gone = _first(tmp_path / "gone", 2)
    gone.served("w1", 1, "patch")
    gone.engines["w1"] -= EngineFirst.FOLLOWING_S + 1  # w1 has not reported for long: gone
    assert gone.due()
    one = _first(tmp_path / "one", 1)
    one.served("w1", 1, "patch")
    assert not one.due()  # below the batch and not idle: not due, engines or not
