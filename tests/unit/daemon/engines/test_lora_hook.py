"""The vllm_lora hook against a stand-in vLLM (its three routes, in aiohttp): what it loads,
that a retry never rewrites the directory being served, that a server listing another
directory under the run's name fails the round, and which directories it keeps."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer

from chain.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from chain.policy import Retention
from chain.store import ChainStore
from chain.weights import WeightsDir
from daemon.config import VllmLoraHook
from daemon.engines.lora import LoraLoadFailed, VllmLoraEngine
from trainer.publisher import Publisher

CONFIG = json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}).encode()


def adapter(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"base_model.model.l.q.lora_{x}.weight": torch.randn(2, 8, generator=g).bfloat16()
            for x in "AB"}


class FakeVllm:
    """Records loads; lists each name at the path it was loaded from (or `lie` instead)."""

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}
        self.calls: list[str] = []
        self.lie: str | None = None

    def app(self) -> web.Application:
        async def load(request: web.Request) -> web.Response:
            body = await request.json()
            assert body["load_inplace"] is True
            assert (Path(body["lora_path"]) / ADAPTER_WEIGHTS).is_file()
            self.loaded[body["lora_name"]] = body["lora_path"]
            self.calls.append("load")
            return web.Response(text="Success")

        async def reset(request: web.Request) -> web.Response:
            self.calls.append("reset")
            return web.json_response({"success": True})

        async def models(request: web.Request) -> web.Response:
            data = [{"id": "base", "root": "/base"}] + [
                {"id": n, "root": self.lie or p, "parent": "base"} for n, p in self.loaded.items()]
            return web.json_response({"data": data})

        app = web.Application()
        app.router.add_post("/v1/load_lora_adapter", load)
        app.router.add_post("/reset_prefix_cache", reset)
        app.router.add_get("/v1/models", models)
        return app


@pytest.fixture
def versions(tmp_path: Path, signing_key) -> tuple[WeightsDir, list[str]]:
    """Ten adapter versions reconstructed the way a region does; their state digests."""
    pub = Publisher(tmp_path / "chain", tmp_path / "trainer.key", run="run-a",
                    retention=Retention(versions=100))
    for v in range(10):
        pub.publish(v, adapter(v), files={ADAPTER_CONFIG: CONFIG})
    store = ChainStore(tmp_path / "chain")
    w = WeightsDir(tmp_path / "weights", keep=12)
    digests = []
    for v in range(10):
        m = store.get(v, "snapshot") or store.get(v, "delta")
        w.apply([m], lambda b: store.blocks.get(b.id, b.size))
        digests.append(m.state_digest)
    return w, digests


async def test_each_version_loads_from_its_own_dir_and_a_retry_keeps_the_served_one(
        tmp_path: Path, versions) -> None:
    weights, digests = versions
    fake = FakeVllm()
    server = TestServer(fake.app())
    await server.start_server()
    try:
        cfg = VllmLoraHook(type="vllm_lora", url=str(server.make_url("")), lora_name="run-a",
                           keep=3)
        async with aiohttp.ClientSession() as s:
            hook = VllmLoraEngine(cfg, s, tmp_path / "state")
            await hook.notify(0, weights.path(0), digests[0])
            served = Path(fake.loaded["run-a"])
            assert served == tmp_path / "state" / "lora" / "run-a" / "v00000000"
            inode = (served / ADAPTER_WEIGHTS).stat().st_ino
            await hook.notify(0, weights.path(0), digests[0])  # the notifier's retry
            assert (served / ADAPTER_WEIGHTS).stat().st_ino == inode
            assert fake.calls == ["load", "reset"] * 2
            for v in range(1, 10):
                await hook.notify(v, weights.path(v), digests[v])
            assert hook.lora.version == 9 and hook.lora.served == {"run-a": 9}
            assert sorted(p.name for p in hook.dirs.iterdir()) == [
                "v00000007", "v00000008", "v00000009"]
            with pytest.raises(Exception, match="no longer holds"):  # dir rewritten since
                await hook.notify(5, weights.path(9), digests[5])
            assert fake.loaded["run-a"].endswith("v00000009")  # nothing was loaded
            fake.lie = str(tmp_path / "elsewhere" / "v00000009")
            with pytest.raises(LoraLoadFailed, match="did not take it"):
                await hook.notify(9, weights.path(9), digests[9])
    finally:
        await server.close()
