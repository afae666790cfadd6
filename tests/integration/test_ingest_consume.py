"""A trainer you bring reads trajectories from a real `deltaswarm ingest --config` process
(token from a file) with trainer.consume.Trajectories: in arrival order, each once, acked ones
never again across restarts of the consumer and a SIGKILL of the ingest, unacked ones handed
out again; a consumer waiting with a timeout gets a trajectory posted meanwhile."""

import json
import threading
import time
from pathlib import Path

import pytest

from tests.integration.harness import TOKEN, http
from tests.integration.ingest_proc import IngestProcess
from tests.trajectories import batch, ids, ndjson
from trainer.consume import Trajectories
from trainer.ingest import IngestStoreError


def _post(ingest: IngestProcess, items: list[dict]) -> None:
    code, raw, _ = http(f"{ingest.url}/v1/ingest", ndjson(items),
                        content_type="application/x-ndjson")
    assert code == 200, raw[:300]


@pytest.mark.timeout(120)
def test_own_trainer_consumes_in_order_once_across_restarts(tmp_path: Path) -> None:
    ingest = IngestProcess(tmp_path, "127.0.0.71")
    with pytest.raises(IngestStoreError, match="start `deltaswarm ingest`"):
        Trajectories(ingest.store_dir)
    first, second, third = batch(12), batch(8), batch(6)
    try:
        ingest.start()
        assert TOKEN not in " ".join(ingest.proc.args)  # nothing secret on the command line
        _post(ingest, first)
        with Trajectories(ingest.store_dir) as t:
            assert [x["id"] for x in t.next(5)] == ids(first)[:5]
            assert t.ack() == 5
            assert [x["id"] for x in t.next(4)] == ids(first)[5:9]  # handed out, never acked
            assert ingest.stats()["consumed"] == 5
        ingest.kill9()
        ingest.start()
        _post(ingest, second + first[:3])  # a retried batch: already held ids are not stored
        with Trajectories(ingest.store_dir) as t:
            got = t.next(100)
            assert [x["id"] for x in got] == ids(first)[5:] + ids(second)
            assert got[0] == json.loads(json.dumps(first[5]))
            t.ack()
            later = threading.Timer(0.5, _post, (ingest, third))
            later.start()
            t0 = time.monotonic()
            assert [x["id"] for x in t.next(100, timeout=20)] == ids(third)
            assert time.monotonic() - t0 < 15
            later.join()
            t.ack()
            assert t.next(1, timeout=0.3) == [] and t.waiting() == 0
        with Trajectories(ingest.store_dir) as t:
            assert t.next(1) == [] and t.acked == 26
            t.rewind_to(20)  # restored an older checkpoint of the trainer
            assert [x["id"] for x in t.next(100)] == ids(third)
        assert ingest.stats() == {"held": 26, "pending": 6, "consumed": 20, "taken": 20}
        ingest.stop()
    finally:
        if ingest.proc is not None and ingest.proc.poll() is None:
            ingest.kill9()
