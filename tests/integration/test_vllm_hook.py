"""VllmServerHook's call order and failure handling against a loopback aiohttp stand-in for
vLLM's dev-mode routes (runs without .venv-vllm; test_vllm_reload checks the real server)."""

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web

from rollout.vllm_server import (
    VllmPatchUnsupported,
    VllmReloadError,
    VllmServerHook,
)


class FakeVllm:
    """Records (route, query, body) per call; `fail` maps a route to an HTTP status to return."""

    def __init__(self, fail: dict[str, int] | None = None, patchable: bool = True,
                 reset_ok: bool = True) -> None:
        self.calls: list[tuple[str, dict, object]] = []
        self.fail = fail or {}
        self.patchable, self.reset_ok = patchable, reset_ok
        self.version = "default"

    async def handle(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read() or b"null")
        route = request.path
        self.calls.append((route, dict(request.query), body))
        if route in self.fail:
            return web.json_response({"error": "boom"}, status=self.fail[route])
        if route == "/collective_rpc":
            if body["method"] == "deltaswarm_info":
                return web.json_response({"results": [{"patchable": self.patchable,
                                                       "empty_params": ["w"]}]})
            return web.json_response({"results": [None]})
        if route == "/reset_prefix_cache":
            return web.json_response({"success": self.reset_ok})
        if route == "/update_weight_version":
            self.version = body["new_version"]
            return web.json_response({"success": True})
        if route == "/tokenize":
            return web.json_response({"tokens": [1] + [5] * len(body["prompt"])})
        if route == "/inference/v1/generate":
            n = body["sampling_params"]["n"]
            return web.json_response({"choices": [
                {"index": i, "text": "ab", "token_ids": [7, 8], "finish_reason": "length",
                 "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]},
                 "weight_versions": [{"version": "4", "start": 0, "end": 1},
                                     {"version": "5", "start": 1, "end": 2}]}
                for i in range(n)]})
        return web.json_response({"status": "ok"})

    def routes(self) -> list[str]:
        return [c[0] for c in self.calls]


async def with_fake(fake: FakeVllm, scenario):
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        return await scenario(VllmServerHook(f"http://127.0.0.1:{port}", timeout_s=10))
    finally:
        await runner.cleanup()


def hf_dir(tmp_path: Path) -> Path:
    d = tmp_path / "v00000005"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (tmp_path / "current").symlink_to(d.name)
    return tmp_path / "current"


def test_reload_pauses_reloads_resets_versions_and_resumes_in_order(tmp_path: Path) -> None:
    fake = FakeVllm()
    report = asyncio.run(with_fake(fake, lambda h: h.reload(hf_dir(tmp_path), 5)))
    assert fake.routes() == ["/pause", "/collective_rpc", "/reset_prefix_cache",
                             "/update_weight_version", "/resume"]
    assert fake.calls[0][1] == {"mode": "keep"}
    assert fake.calls[1][2] == {"method": "reload_weights",
                                "kwargs": {"weights_path": str(tmp_path / "v00000005")}}
    assert fake.calls[2][1] == {"reset_running_requests": "true"}
    assert fake.version == "5"
    assert report.path == str(tmp_path / "v00000005") and report.mode == "directory"


def test_reload_of_changed_tensors_names_them(tmp_path: Path) -> None:
    fake = FakeVllm()
    asyncio.run(with_fake(fake, lambda h: h.reload(hf_dir(tmp_path), 5, changed=["a.weight"])))
    assert fake.calls[1][2]["method"] == "reload_changed"
    assert fake.calls[1][2]["kwargs"]["names"] == ["a.weight"]


@pytest.mark.parametrize("fake", [FakeVllm(fail={"/collective_rpc": 500}),
                                  FakeVllm(reset_ok=False)], ids=["rpc-fails", "reset-refused"])
def test_a_failed_reload_leaves_vllm_paused_and_the_version_unchanged(
        fake: FakeVllm, tmp_path: Path) -> None:
    with pytest.raises(VllmReloadError, match="left paused"):
        asyncio.run(with_fake(fake, lambda h: h.reload(hf_dir(tmp_path), 5)))
    assert "/resume" not in fake.routes()
    assert "/update_weight_version" not in fake.routes()
    assert fake.version == "default"


def test_reload_refuses_a_directory_without_config_json(tmp_path: Path) -> None:
    fake = FakeVllm()
    with pytest.raises(ValueError, match=r"config\.json"):
        asyncio.run(with_fake(fake, lambda h: h.reload(tmp_path, 5)))
    assert fake.calls == []


def test_patch_is_refused_before_pausing_when_weights_are_in_kernel_layout(
        tmp_path: Path) -> None:
    fake = FakeVllm(patchable=False)
    with pytest.raises(VllmPatchUnsupported):
        asyncio.run(with_fake(fake, lambda h: h.apply_patch(tmp_path / "p.safetensors", 5)))
    assert fake.routes() == ["/collective_rpc"]


def test_patch_is_staged_before_the_pause(tmp_path: Path) -> None:
    fake = FakeVllm()
    asyncio.run(with_fake(fake, lambda h: h.apply_patch(tmp_path / "p.safetensors", 5)))
    methods = [c[2]["method"] if c[0] == "/collective_rpc" else c[0] for c in fake.calls]
    assert methods == ["deltaswarm_info", "stage_patch", "/pause", "apply_patch",
                       "/reset_prefix_cache", "/update_weight_version", "/resume"]


def test_generate_tags_each_completion_with_the_oldest_version_of_its_tokens() -> None:
    fake = FakeVllm()
    out = asyncio.run(with_fake(fake, lambda h: h.generate(["x", "yz"], n=2, max_tokens=2)))
    assert [c.prompt for c in out] == ["x", "x", "yz", "yz"]
    assert [c.prompt_ids for c in out][2] == [1, 5, 5]
    assert {c.version for c in out} == {4}
    assert out[0].logprobs == [-0.5, -0.25] and out[0].token_ids == [7, 8]
