"""Trajectories are never lost or doubled: a region daemon spools what workers post while its
upstream is down (and across a kill -9 of the daemon), forwards once the upstream is back, and
deletes only what the upstream acknowledged; what the upstream refuses as invalid is set aside
and the stream moves on. Also: 429 + Retry-After when the spool is full, 400 naming the line,
trajectory and field for a bad batch (what the trainer's ingest would refuse), 401 without the
token, and a big batch parsed without stalling the event loop."""

import asyncio
import io
import json
import resource
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from daemon.trajectories.spool import Spool
from tests.integration.harness import TOKEN, Cluster, free_port, http, wait_until
from tests.integration.ingest_proc import IngestProcess
from tests.support import HealthProbe
from tests.trajectories import DROP, ids, ndjson, trajectory
from tests.trajectories import batch as make_batch


class Ingest:
    """A stand-in for the trainer's ingest endpoint (dedupes by id, replies {"held": ids})."""

    def __init__(self, host: str, port: int,
                 refuse: Callable[[dict], bool] = lambda t: False) -> None:
        self.host, self.port, self.refuse = host, port, refuse
        self.received: list[str] = []
        self.held: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    async def _ingest(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"error": "token"}, status=401)
        lines = [json.loads(line) for line in (await request.read()).splitlines() if line]
        bad = [n for n, t in enumerate(lines, 1) if self.refuse(t)]
        if bad:
            return web.json_response({"error": f"line {bad[0]}: field worker: refused"},
                                     status=400)
        got = [t["id"] for t in lines]
        self.received.extend(got)
        self.held.update(got)
        return web.json_response({"held": got})

    def start(self) -> None:
        ready = threading.Event()

        async def main() -> None:
            app = web.Application()
            app.router.add_post("/v1/ingest", self._ingest)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            await web.TCPSite(self._runner, self.host, self.port).start()
            ready.set()

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(main(), self._loop).result(10)
        ready.wait(10)

    def stop(self) -> None:
        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._loop = None


def batch(n: int) -> tuple[list[str], bytes]:
    trajs = make_batch(n)
    return ids(trajs), ndjson(trajs)


def post(url: str, body: bytes, token: str | None = TOKEN) -> tuple[int, dict, dict]:
    code, raw, headers = http(f"{url}/v1/trajectories", body, token=token,
                              content_type="application/x-ndjson")
    return code, json.loads(raw), headers


def test_trajectories_cross_a_cut_upstream_and_a_daemon_kill_exactly_once(tmp_path: Path
                                                                          ) -> None:
    host = "127.0.0.60"
    ingest = Ingest(host, free_port(host))
    upstream = f"http://{host}:{ingest.port}/v1/ingest"
    with Cluster(tmp_path) as c:
        r1 = c.region("r1", bootstrap=[], trajectories={
            "upstream": upstream, "retry_initial_s": 0.2, "retry_max_s": 1.0, "batch_size": 7})
        c.start_all()
        sent: list[str] = []
        try:
            for _ in range(5):  # upstream down: everything is spooled
                ids, body = batch(20)
                code, reply, _ = post(r1.url, body)
                assert code == 200 and reply["held"] == ids
                sent += ids
            code, reply, _ = post(r1.url, body)  # a retry of the last batch is a no-op
            assert code == 200 and reply["held"] == ids
            spool = r1.status()["spool"]
            assert spool["depth"] == 100 and spool["forwarded"] == 0 and spool["errors"] >= 1

            r1.kill9()  # nothing spooled is lost
            r1.start()
            r1.wait_ready()
            assert r1.status()["spool"]["depth"] == 100

            ingest.start()  # the link comes back
            wait_until(lambda: r1.status()["spool"]["depth"] == 0, 30, "the spool to drain")
            assert r1.status()["spool"]["forwarded"] == 100

            ingest.stop()  # cut again while more arrives
            ids, body = batch(30)
            assert post(r1.url, body)[0] == 200
            sent += ids
            ingest.start()
            wait_until(lambda: r1.status()["spool"]["depth"] == 0, 30, "the spool to drain")
        finally:
            ingest.stop()
        assert sorted(ingest.held) == sorted(sent)
        assert len(ingest.received) == len(set(ingest.received)) == len(sent)


def test_full_spool_pushes_back_and_bad_input_is_refused(tmp_path: Path) -> None:
    with Cluster(tmp_path) as c:
        r1 = c.region("r1", bootstrap=[], trajectories={"spool_max_bytes": 65536})
        c.start_all()
        _, body = batch(100)  # ~20 KB
        assert post(r1.url, body)[0] == 200
        codes = [post(r1.url, batch(100)[1]) for _ in range(3)]
        full = [x for x in codes if x[0] == 429]
        assert full and int(full[0][2]["Retry-After"]) >= 1
        assert "retry later" in full[0][1]["error"]
        assert r1.status()["spool"]["rejected_full"] == len(full)

        code, reply, _ = post(r1.url, ndjson([trajectory(), trajectory(id=5)]))
        assert code == 400 and "line 2 (trajectory 1): field id" in reply["error"]
        assert post(r1.url, body, token="wrong-token-123")[0] == 401
        code, raw, _ = http(f"{r1.url}/v1/chain/head?after=abc")
        assert code == 400 and b"after" in raw
        code, raw, _ = http(f"{r1.url}/v1/chain/manifests/..%2Fetc")
        assert code in (400, 404)
        assert http(f"{r1.url}/healthz", token=None)[0] == 200
        assert http(f"{r1.url}/metrics", token=None)[0] == 200


NESTED = b'{"extra": ' + b"[" * 5000 + b"]" * 5000 + b"}\n"


BAD = [
    (ndjson([trajectory(id="not-hex-" + "a" * 24)]), "field id: String should match pattern"),
    (ndjson([trajectory(logprobs=DROP)]), "field logprobs: Field required"),
    (ndjson([trajectory(logprobs=[-0.5, float("-inf"), -0.1])]),
     "field logprobs.1: Input should be a finite number"),
    (ndjson([trajectory(reward=float("nan"))]), "field reward: Input should be a finite number"),
    (NESTED, "not valid JSON (recursion limit exceeded"),
]


def test_what_the_ingest_would_refuse_is_refused_at_the_daemon_with_400(tmp_path: Path) -> None:
    """Issue 10 item 6: the spool used to take these, then the ingest refused them and the
    forwarder resent them for ever. A nested line gave HTTP 500."""
    with Cluster(tmp_path) as c:
        r1 = c.region("r1", bootstrap=[])
        c.start_all()
        for bad, message in BAD:
            code, reply, _ = post(r1.url, ndjson(make_batch(2)) + bad)
            assert code == 400, reply
            assert "line 3 (trajectory 2): " + message in reply["error"], reply
            assert reply["trajectory"] == 2
        assert r1.status()["spool"]["depth"] == 0


def test_a_trajectory_the_upstream_refuses_is_set_aside_and_the_stream_moves_on(
        tmp_path: Path) -> None:
    """Issue 10 item 6, against the real `deltaswarm ingest`: a trajectory this daemon spooled
    under other rules (written into its spool while it was down, as an older daemon would have
    accepted it: version -1) is refused by the ingest with 400 naming its index in the batch.
    The forwarder takes that index (not the halving fallback): the poison goes to the rejected
    store with the ingest's reply, naming position 2 of the 7 sent; the others, before and after
    it, arrive exactly once."""
    ingest = IngestProcess(tmp_path, "127.0.0.61")
    upstream = f"{ingest.url}/v1/ingest"
    first, poison, later = make_batch(20), trajectory(version=-1), make_batch(10)
    with Cluster(tmp_path / "cluster") as c:
        r1 = c.region("r1", bootstrap=[], trajectories={
            "upstream": upstream, "retry_initial_s": 0.2, "retry_max_s": 1.0, "batch_size": 7})
        spool_dir = r1.state_dir / "spool"
        spool_dir.mkdir(parents=True, exist_ok=True)
        old = Spool(spool_dir, 1 << 20)
        lines = [(t["id"], json.dumps(t).encode()) for t in [*first[:2], poison, *first[2:]]]
        assert old.append(lines)[1] == 21
        old.close()
        ingest.start()
        try:
            c.start_all()
            wait_until(lambda: r1.status()["spool"]["depth"] == 0, 30, "the spool to drain")
            assert post(r1.url, ndjson(later))[0] == 200
            wait_until(lambda: r1.status()["spool"]["depth"] == 0, 30, "the later batch")
            assert r1.status()["spool"]["forwarded"] == 30
            assert r1.stop() == 0
            held = ingest.stats()["held"]
        finally:
            ingest.stop()
    assert held == 30
    spool = Spool(r1.state_dir / "spool", 1 << 20)
    assert spool.rejected == 1 and spool.depth() == 0
    [kept] = spool.rejected_items()
    assert kept["id"] == poison["id"] and kept["status"] == 400
    reply = json.loads(kept["reason"])
    assert reply["trajectory"] == 2 and "version" in reply["error"], reply


def test_a_64mb_batch_does_not_stall_healthz(tmp_path: Path) -> None:
    """Issue 10 item 9: NDJSON parsed on the event loop held /healthz for ~3 s during a 64 MB
    batch. A behavioural check with a generous bound (1 s), not a speed test."""
    trajs = make_batch(90_000, pad=450)
    body = ndjson(trajs)
    with Cluster(tmp_path) as c:
        r1 = c.region("r1", bootstrap=[])
        c.start_all()
        probe = HealthProbe(f"{r1.url}/healthz")
        probe.start()
        try:
            req = urllib.request.Request(
                f"{r1.url}/v1/trajectories", data=io.BytesIO(body), method="POST",
                headers={"Authorization": f"Bearer {TOKEN}", "Content-Length": str(len(body)),
                         "Content-Type": "application/x-ndjson"})
            with urllib.request.urlopen(req, timeout=120) as r:
                assert json.loads(r.read())["held"] == ids(trajs)
        finally:
            probe.done.set()
            probe.join(30)
        assert r1.status()["spool"]["depth"] == 90_000
    times = probe.times
    print(f"/healthz during a {len(body) >> 20} MiB batch: {len(times)} probes, worst "
          f"{max(times):.3f} s")
    assert len(times) >= 3 and max(times) < 1.0, f"/healthz took {max(times):.2f} s"


def test_a_post_the_disk_refuses_is_503_and_nothing_acknowledged_is_lost_after_kill9(
        tmp_path: Path) -> None:
    """Issue 10 item 7 on a real daemon: while its file-size limit (prlimit, as `prlimit --fsize`)
    stops writes half-way, batch B gets 503 (was 500); C, posted once the limit is lifted, is
    acknowledged and survives a kill -9 (it was lost: appended onto B's partial line); B's
    resend is stored once."""
    a, b, c = make_batch(5), make_batch(60, pad=2000), make_batch(5)
    with Cluster(tmp_path) as cl:
        r1 = cl.region("r1", bootstrap=[])
        cl.start_all()
        assert post(r1.url, ndjson(a))[0] == 200
        spool_dir = r1.state_dir / "spool"
        biggest = max(p.stat().st_size for p in spool_dir.iterdir())
        unlimited = resource.prlimit(r1.proc.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(r1.proc.pid, resource.RLIMIT_FSIZE, (biggest + 300, unlimited[1]))
        try:
            code, reply, headers = post(r1.url, ndjson(b))
        finally:
            resource.prlimit(r1.proc.pid, resource.RLIMIT_FSIZE, unlimited)
        assert code == 503 and "nothing of this batch was stored" in reply["error"], reply
        assert int(headers["Retry-After"]) >= 1
        assert post(r1.url, ndjson(c))[0] == 200
        r1.kill9()
        r1.start()
        r1.wait_ready()
        assert r1.status()["spool"]["depth"] == 10
        code, reply, _ = post(r1.url, ndjson(b))
        assert code == 200 and reply["held"] == ids(b)
        assert r1.status()["spool"]["depth"] == 70
        assert r1.stop() == 0
    spool = Spool(r1.state_dir / "spool", 1 << 30)
    assert [t for t, _ in spool.take(1000, 1 << 30)] == ids(a) + ids(c) + ids(b)
