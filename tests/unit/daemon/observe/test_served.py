"""Per-route response counters (daemon/observe/served.py) as a real aiohttp app sends them, and
read back from the exposition the way benches and tests read them."""

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry, generate_latest

from daemon.observe.served import ServedBytes, route_counts


async def manifest(request: web.Request) -> web.Response:
    return web.Response(body=b"x" * 1000)


async def head(request: web.Request) -> web.Response:
    return web.json_response({"version": 3})


async def test_each_route_counts_its_responses_and_body_bytes() -> None:
    served = ServedBytes()
    app = web.Application()
    app.add_routes([web.get("/v1/chain/manifests/{artifact}", manifest),
                    web.get("/v1/chain/head", head)])
    served.attach(app)
    async with TestClient(TestServer(app)) as client:
        for name in ("a", "b"):
            assert (await client.get(f"/v1/chain/manifests/{name}")).status == 200
        assert (await client.get("/v1/chain/head")).status == 200
        assert (await client.get("/nowhere")).status == 404
    registry = CollectorRegistry()
    registry.register(served)
    text = generate_latest(registry).decode()
    assert route_counts(text, "deltaswarm_http_responses") == {
        "/v1/chain/manifests/{artifact}": 2, "/v1/chain/head": 1, "unmatched": 1}
    body = route_counts(text, "deltaswarm_http_response_bytes")
    assert body["/v1/chain/manifests/{artifact}"] == 2000
    assert body["/v1/chain/head"] == len(b'{"version": 3}')
