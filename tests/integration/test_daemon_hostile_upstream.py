"""A trajectory upstream answering 429 with `Retry-After: nan` then `-1` (issue 10 item 2)
neither kills a region's forwarder nor makes it spin (the forwarder in daemon/trajectories/spool.py
reads
the header with `chain.trajectory.retry_after_s`)."""

import time
from pathlib import Path

from tests.integration.harness import Cluster, Hostile, http
from tests.trajectories import ndjson, trajectory


def test_retry_after_nan_and_negative_neither_kill_nor_spin_the_forwarder(tmp_path: Path
                                                                          ) -> None:
    up = Hostile(tmp_path, "127.0.0.81", "upstream").wait_ready()
    try:
        with Cluster(tmp_path) as c:
            r = c.region("r1", bootstrap=[],
                         trajectories={"upstream": f"{up.url}/ingest", "retry_initial_s": 0.5})
            c.start_all()
            line = ndjson([trajectory()])
            code, body, _ = http(f"{r.url}/v1/trajectories", line,
                                 content_type="application/x-ndjson")
            assert code == 200, body
            time.sleep(5)
            assert r.proc.poll() is None, r.log()
            posts = [x for x in up.requests() if x.startswith("POST /ingest")]
            assert 1 <= len(posts) <= 12, len(posts)
    finally:
        up.stop()
