"""Trajectories end to end across a trainer restart and a cut link: rollout batches posted to a
real region daemon reach a real trainer ingest process (`deltaswarm ingest --config`) that is
SIGKILLed mid-stream and restarted, then stopped for a while; the ingest's store on disk ends
holding exactly the ids sent, each stored once, and the daemon's spool is empty."""

import json
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.integration.harness import Cluster, http, wait_until
from tests.integration.ingest_proc import IngestProcess
from tests.trajectories import batch, ids, ndjson
from trainer.ingest import IngestStore


def trajectories(n: int) -> tuple[list[str], bytes]:
    """`n` valid trajectories in groups of 4, as an NDJSON body."""
    items = batch(n)
    return ids(items), ndjson(items)


def post(daemon_url: str, body: bytes) -> list[str]:
    code, raw, _ = http(f"{daemon_url}/v1/trajectories", body, content_type="application/x-ndjson")
    assert code == 200, f"daemon refused a batch: {code} {raw[:300]!r}"
    return json.loads(raw)["held"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_trajectories_survive_trainer_kill_and_cut_link_exactly_once(tmp_path: Path) -> None:
    ingest = IngestProcess(tmp_path, "127.0.0.70")
    with Cluster(tmp_path / "cluster") as c:
        r1 = c.region("r1", bootstrap=[], trajectories={
            "upstream": f"{ingest.url}/v1/ingest", "retry_initial_s": 0.2, "retry_max_s": 1.0,
            "batch_size": 7})
        try:
            ingest.start()
            c.start_all()
            spool = lambda: r1.status()["spool"]  # noqa: E731
            sent: list[str] = []

            ids_a, body_a = trajectories(40)
            assert post(r1.url, body_a) == ids_a
            sent += ids_a
            wait_until(lambda: spool()["depth"] == 0, 30, "the first batch to be forwarded")
            assert ingest.stats()["held"] == 40

            # Trainer restart: SIGKILL the ingest while the daemon is streaming a big batch.
            ids_b, body_b = trajectories(210)
            assert post(r1.url, body_b) == ids_b
            sent += ids_b
            held_at_kill = wait_until(lambda: ingest.stats()["held"] > 40 and
                                      ingest.stats()["held"], 30, "forwarding to start",
                                      interval=0.01)
            ingest.kill9()
            undelivered = spool()["depth"]
            print(f"ingest SIGKILLed holding ~{held_at_kill} of {len(sent)}; "
                  f"daemon spool depth {undelivered}")
            # The premise: the kill really cut the stream (some of B were never acknowledged).
            assert held_at_kill < len(sent) and undelivered > 0, (held_at_kill, undelivered)
            ingest.start()
            # A worker resends batch B (its reply was lost): the restarted ingest must know
            # these ids from disk and store none of them again.
            assert post(r1.url, body_b) == ids_b
            wait_until(lambda: spool()["depth"] == 0, 60, "the spool to drain after restart")
            assert ingest.stats()["held"] == len(sent)

            # Cut link: the ingest is down while more arrives; the forwarder retries with backoff.
            ingest.stop()
            errors_before = spool()["errors"]
            ids, body = trajectories(30)
            assert post(r1.url, body) == ids
            sent += ids
            ids, body = trajectories(30)
            assert post(r1.url, body) == ids
            sent += ids
            assert post(r1.url, body_a) == ids_a  # a late resend of what the ingest holds
            t_cut = time.monotonic()
            wait_until(lambda: spool()["errors"] >= errors_before + 3, 30,
                       "the forwarder to retry against the cut link")
            time.sleep(max(0.0, 4.0 - (time.monotonic() - t_cut)))
            down = spool()
            retries = down["errors"] - errors_before
            print(f"cut link: {retries} failed forwards in {time.monotonic() - t_cut:.1f} s; "
                  f"last error {down['last_error']!r}")
            assert down["depth"] == 100, down
            # backoff (0.2 s doubling to 1 s, jittered) allows about 6-10 tries in ~4 s, not a
            # tight loop of hundreds
            assert 3 <= retries <= 20, down
            ingest.start()
            wait_until(lambda: spool()["depth"] == 0, 60, "the spool to drain after the cut")
            final = spool()
            assert final["depth"] == 0 and final["bytes"] == 0
            assert final["forwarded"] >= len(sent) + 40
            ingest.stop()
        finally:
            if ingest.proc is not None and ingest.proc.poll() is None:
                ingest.kill9()

    store = IngestStore(ingest.store_dir)
    on_disk = store.held_ids()
    twice = [tid for tid, n in Counter(on_disk).items() if n > 1]
    assert not twice, f"{len(twice)} ids stored more than once, e.g. {twice[:3]}"
    assert set(on_disk) == set(sent) and len(on_disk) == len(sent)
    assert store.ids == set(sent)
    assert store.stats()["pending"] == len(sent)

