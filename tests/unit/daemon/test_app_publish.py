"""POST /v1/publish turns a refused publish into a 4xx with the reason, never a bare 500."""

from types import SimpleNamespace

from aiohttp.test_utils import TestClient, TestServer

from daemon.app import build_app
from daemon.versions.publish import PublishError


class RefusingRole:
    name = "trainer"

    async def publish(self, version: int) -> dict:
        raise PublishError(404, f"no manifest for v{version} under /x; write it first")


async def test_a_refused_publish_answers_its_status_and_reason() -> None:
    node = SimpleNamespace(token="t", role=RefusingRole(), book=None, max_body_bytes=1 << 20)
    async with TestClient(TestServer(build_app(node))) as client:
        r = await client.post("/v1/publish", json={"version": 3},
                              headers={"Authorization": "Bearer t"})
        status, body = r.status, await r.json()
    assert status == 404
    assert "no manifest for v3" in body["error"]
