"""Trajectories are never lost or doubled: a region daemon spools what workers post while its
upstream is down (and across a kill -9 of the daemon), forwards once the upstream is back, and
deletes only what the upstream acknowledged. Also: 429 + Retry-After when the spool is full,
400 naming the line for a bad batch, 401 without the token."""

import asyncio
import json
import threading
import uuid
from pathlib import Path

from aiohttp import web

from tests.integration.harness import TOKEN, Cluster, free_port, http, wait_until


class Ingest:
    """A stand-in for the trainer's ingest endpoint (dedupes by id, replies {"held": ids})."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.received: list[str] = []
        self.held: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    async def _ingest(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"error": "token"}, status=401)
        ids = [json.loads(line)["id"] for line in (await request.read()).splitlines() if line]
        self.received.extend(ids)
        self.held.update(ids)
        return web.json_response({"held": ids})

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
    ids = [uuid.uuid4().hex for _ in range(n)]
    lines = [json.dumps({"id": i, "version": 0, "group": "g", "prompt": "1+1=",
                         "completion": "2", "reward": 1.0, "region": "r1", "worker": "w",
                         "created": 0.0}) for i in ids]
    return ids, "\n".join(lines).encode()


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

        code, reply, _ = post(r1.url, b'{"id": "ok", "version": 1}\n{"id": 5}\n')
        assert code == 400 and "line 2" in reply["error"]
        assert post(r1.url, body, token="wrong-token-123")[0] == 401
        code, raw, _ = http(f"{r1.url}/v1/chain/head?after=abc")
        assert code == 400 and b"after" in raw
        code, raw, _ = http(f"{r1.url}/v1/chain/manifests/..%2Fetc")
        assert code in (400, 404)
        assert http(f"{r1.url}/healthz", token=None)[0] == 200
        assert http(f"{r1.url}/metrics", token=None)[0] == 200
