"""A fresh region host applies its first delta without compiling anything (issue 19, item 3).

The region daemon starts with an empty numba cache (`NUMBA_CACHE_DIR` a new directory): with
the kernels compiled at install (chain/codec/aot.py) it applies a snapshot and a delta, its
HTTP API answering throughout, and numba writes nothing into that cache, because no kernel was
JIT-compiled, neither by the start-up warm-up nor by the apply. Before the AOT kernels the
warm-up compiled the encoder and decoder there (15-58 s) while the first apply waited for it.
"""

from pathlib import Path

import pytest

from chain.codec import aot
from tests.integration.harness import Cluster, http, step, tiny_model
from tests.support import wait_until

pytestmark = pytest.mark.skipif(
    aot.status()["kernels"] != "aot",
    reason=f"no compiled kernels here ({aot.status()['reason']}); make install builds them")


def test_region_with_empty_numba_cache_applies_first_delta_compiling_nothing(
        tmp_path: Path) -> None:
    cache = tmp_path / "numba-cache"
    cache.mkdir()
    with Cluster(tmp_path) as c:
        c.trainer()
        r1 = c.region("r1")
        c.daemons["trainer"].start()
        r1.start(env_extra={"NUMBA_CACHE_DIR": str(cache)})
        for d in c.daemons.values():
            d.wait_ready(90)
        state = tiny_model()
        c.publish(0, state, snapshot=True)
        state = step(state, 1)
        c.publish(1, state)
        answered = []

        def current_while_answering() -> bool:
            try:  # a stalled API times out (OSError), which wait_until would otherwise swallow
                code = http(f"{r1.url}/healthz", token=None, timeout=5)[0]
            except OSError as e:
                code = f"{type(e).__name__}: {e}"
            answered.append(code)
            return code == 200 and r1.current() == 1

        wait_until(current_while_answering, 120, "r1 to apply v1", interval=0.2)
        assert set(answered) == {200}
        warm = r1.status()["warmup"]
        assert warm["state"] == "ready", warm
        assert warm["kernels"] == "aot", warm
        compiled = sorted(p.name for p in cache.rglob("*") if p.is_file())
        assert compiled == [], f"r1 JIT-compiled kernels into its empty cache: {compiled[:5]}"
