"""GET /v1/chain/head records who polls and what it holds (`node`, `region`, `have`): the input
of retention that knows who is behind. Bad values answer 400 naming the parameter."""

from types import SimpleNamespace

from aiohttp.test_utils import TestClient, TestServer

from daemon.app import build_app
from daemon.board import Board
from daemon.live import LiveNodes


class Store:
    def head(self) -> int:
        return 4

    def artifacts(self) -> list[str]:
        return ["v00000004.delta"]


async def test_a_head_poll_records_the_poller_and_refuses_bad_values() -> None:
    live = LiveNodes()
    node = SimpleNamespace(token="t", book=None, store=Store(), board=Board(), live=live,
                           long_poll_timeout_s=1.0, stopping=lambda: False, bt=lambda: "x:1",
                           node="trainer", url="http://127.0.0.1:1", max_body_bytes=1 << 20)
    auth = {"Authorization": "Bearer t"}
    async with TestClient(TestServer(build_app(node))) as client:
        r = await client.get("/v1/chain/head?node=r1&region=eu&have=3", headers=auth)
        assert r.status == 200 and (await r.json())["version"] == 4
        r = await client.get("/v1/chain/head?node=r2&have=", headers=auth)
        assert r.status == 200
        bad = [await client.get(f"/v1/chain/head?{q}", headers=auth)
               for q in ("node=a/b", "node=r3&region=%20", "node=r3&have=-1", "node=r3&have=x")]
        errors = [(b.status, (await b.json())["error"]) for b in bad]
    assert sorted(live.versions(), key=str) == [3, None]
    assert [s for s, _ in errors] == [400] * 4
    assert "node or region" in errors[0][1] and "have" in errors[3][1]
