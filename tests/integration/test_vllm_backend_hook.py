"""The daemon's vLLM backend hook (daemon/engines/vllm.py): its call order, how a failed weight
check sets off a full reload, and that weights which never verify leave vLLM paused. Against a
loopback aiohttp stand-in for vLLM's RL routes that writes worker reports as the deltaswarm
backend does (runs without .venv-vllm; test_vllm_swarm drives the real backend)."""

import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from daemon.config import VllmHook
from daemon.engines.hooks import VllmNotifyHook, build_hook
from daemon.engines.vllm import EngineRoundFailed, VllmBackendHook
from daemon.observe.metrics import build_registry, render
from daemon.observe.status import EngineCheckStatus, NodeStatus


class FakeBackend:
    """Records (route, query, body); `verdicts` says per round whether the check passes
    (None: the worker writes no report). The last verdict repeats."""

    def __init__(self, verdicts: list[bool | None], refuse_patches: bool = False) -> None:
        self.verdicts = verdicts
        self.refuse_patches = refuse_patches
        self.told = False
        """Whether init_weight_transfer_engine came since the last `restart()`."""
        self.calls: list[tuple[str, dict, dict]] = []
        self.report_dir: Path | None = None
        self.update: dict = {}

    async def handle(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read() or b"{}")
        self.calls.append((request.path, dict(request.query), body))
        if request.path == "/init_weight_transfer_engine":
            self.report_dir = Path(body["init_info"]["report_dir"])
            self.told = True
        elif request.path == "/update_weights":
            self.update = body["update_info"]
            if not self.told:  # as the backend refuses a path before it knows its weights_dir
                return web.json_response({"error": "no weights_dir yet"}, status=400)
            if self.refuse_patches and "patch" in self.update:
                return web.json_response({"error": "cannot patch in place"}, status=400)
        elif request.path == "/finish_weight_update":
            ok = self.verdicts[0] if len(self.verdicts) == 1 else self.verdicts.pop(0)
            if ok is not None:
                assert self.report_dir is not None
                bad = [] if ok else ["model.layers.0.mlp.down_proj.weight"]
                (self.report_dir / "dp0-rank0.json").write_text(json.dumps({
                    "ticket": self.update["ticket"], "worker": "dp0-rank0",
                    "version": self.update["version"], "mode": self.update["mode"],
                    "loaded_tensors": 3, "loaded_bytes": 300, "error": None,
                    "check": {"ok": ok, "checked": 20 if ok else 19, "mismatched": bad,
                              "mismatched_count": len(bad), "unreadable_count": 1,
                              "seconds": 0.01}}))
        elif request.path == "/reset_prefix_cache":
            return web.json_response({"success": True})
        return web.json_response({"status": "ok"})

    def restart(self) -> None:
        """vLLM restarted: it no longer knows where the weights are."""
        self.told = False

    def routes(self) -> list[str]:
        return [c[0] for c in self.calls]

    def modes(self) -> list[str]:
        return [c[2]["update_info"]["mode"] for c in self.calls if c[0] == "/update_weights"]


async def run_hook(fake: FakeBackend, tmp_path: Path, version: int = 5,
                   versions: int = 1, patches: bool = False,
                   between=None) -> VllmBackendHook:
    """Notify `versions` versions from `version` on, each with a patch file if `patches`."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    cfg = VllmHook(type="vllm", url=f"http://127.0.0.1:{port}", timeout_s=10)
    try:
        async with aiohttp.ClientSession() as session:
            hook = VllmBackendHook(cfg, session, tmp_path / "state")
            try:
                for v in range(version, version + versions):
                    vdir = tmp_path / "weights" / f"v{v:08d}"
                    vdir.mkdir(parents=True)
                    (vdir / "VERSION.json").write_text("{}")  # on disk: a refusal's fallback
                    patch = tmp_path / "patches" / f"v{v:08d}.patch" if patches else None
                    if patch is not None:
                        patch.parent.mkdir(exist_ok=True)
                        patch.write_bytes(b"")
                    await hook.notify(v, vdir, "digest", patch=patch)
                    if between is not None:
                        await between(hook)
            finally:
                fake.hook = hook
            return hook
    finally:
        await runner.cleanup()


async def test_an_update_names_the_version_and_resumes_once_the_check_passes(
        tmp_path: Path) -> None:
    fake = FakeBackend([True])
    hook = await run_hook(fake, tmp_path)
    assert fake.routes() == ["/init_weight_transfer_engine", "/pause", "/start_weight_update",
                             "/update_weights", "/finish_weight_update", "/reset_prefix_cache",
                             "/resume"]
    assert fake.calls[0][2]["init_info"]["weights_dir"] == str(tmp_path / "weights")
    assert fake.calls[1][1] == {"mode": "keep"}
    assert fake.update["version"] == 5 and fake.update["mode"] == "auto"
    assert fake.update["path"] == str(tmp_path / "weights" / "v00000005")
    assert fake.calls[4][2] == {"weight_version": "5"}
    c = hook.check
    assert (c.ok, c.last_version, c.checks, c.checked, c.unreadable) == (True, 5, 1, 20, 1)
    assert (c.mismatches, c.repairs) == (0, 0)


async def test_the_backend_is_told_where_things_are_once_until_a_round_fails(
        tmp_path: Path) -> None:
    """init_weight_transfer_engine costs every version 11-16 ms: it is sent once, and again
    after a refused patch (a restarted vLLM has forgotten it) before the directory round."""
    fake = FakeBackend([True])
    await run_hook(fake, tmp_path, versions=3, patches=True)
    assert fake.routes().count("/init_weight_transfer_engine") == 1
    assert fake.routes().count("/update_weights") == 3
    refused = FakeBackend([True], refuse_patches=True)
    await run_hook(refused, tmp_path / "again", versions=2, patches=True)
    routes = refused.routes()
    assert routes.count("/init_weight_transfer_engine") == 3  # first, then after each refusal
    first_retry = routes.index("/update_weights") + 1
    assert routes[first_retry:first_retry + 3] == [
        "/init_weight_transfer_engine", "/start_weight_update", "/update_weights"]
    assert [c[2]["update_info"].get("patch") is None for c in refused.calls
            if c[0] == "/update_weights"] == [False, True, False, True]


async def test_a_vllm_restarted_between_versions_is_told_again_and_the_round_repeated(
        tmp_path: Path) -> None:
    """No round failed before the restart, so the hook still believes vLLM knows its
    directories: the refused round tells it again and runs once more, for an update and for a
    requested full check."""
    fake = FakeBackend([True])
    checks: list = []

    async def restart_then_check(hook: VllmBackendHook) -> None:
        fake.restart()
        checks.append(await hook.full_check())
        fake.restart()

    hook = await run_hook(fake, tmp_path, versions=2, between=restart_then_check)
    # v5 tells it; after each of three restarts a refused round (check, v6, check) tells again
    assert fake.routes().count("/init_weight_transfer_engine") == 4
    assert [c["ok"] for c in checks] == [True, True]
    assert hook.check.last_version == 6 and hook.check.ok


async def test_a_mismatch_sets_off_a_full_reload_and_is_reported(tmp_path: Path) -> None:
    fake = FakeBackend([False, True])
    hook = await run_hook(fake, tmp_path)
    assert fake.modes() == ["auto", "full"]
    assert fake.routes()[-2:] == ["/reset_prefix_cache", "/resume"]
    c = hook.check
    assert (c.ok, c.mismatches, c.repairs, c.repair_failures, c.mode) == (True, 1, 1, 0, "full")
    assert c.mismatched == ["model.layers.0.mlp.down_proj.weight"]
    assert c.last_mismatch_version == 5


@pytest.mark.parametrize("verdicts", [[False], [None]], ids=["still-differs", "no-report"])
async def test_weights_that_never_verify_leave_vllm_paused_and_fail_the_hook(
        verdicts: list[bool | None], tmp_path: Path) -> None:
    fake = FakeBackend(verdicts)
    with pytest.raises(EngineRoundFailed, match="left paused"):
        await run_hook(fake, tmp_path)
    assert fake.modes() == ["auto", "full"]
    assert "/resume" not in fake.routes()
    assert fake.hook.check.repair_failures == 1
    assert fake.hook.check.last_error


def samples(status: NodeStatus) -> dict[str, float]:
    text = render(build_registry(lambda: status))[0].decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_the_check_shows_in_metrics() -> None:
    sample = samples(NodeStatus(node="n", engine_check=EngineCheckStatus(
        ok=False, checks=4, mismatches=1, repairs=1, checked=19, unreadable=2, update_s=0.5)))
    assert sample["deltaswarm_engine_checks_total"] == 4
    assert sample["deltaswarm_engine_check_mismatches_total"] == 1
    assert sample["deltaswarm_engine_repairs_total"] == 1
    assert sample["deltaswarm_engine_check_ok"] == 0
    assert sample["deltaswarm_engine_unreadable_tensors"] == 2
    assert "deltaswarm_engine_checks_total" not in samples(NodeStatus())


async def test_the_config_picks_the_backend_by_default_and_the_reload_path_on_request(
        tmp_path: Path) -> None:
    url = "http://127.0.0.1:9"
    async with aiohttp.ClientSession() as session:
        assert isinstance(build_hook(VllmHook(type="vllm", url=url), session, "t", tmp_path),
                          VllmBackendHook)
        assert isinstance(build_hook(VllmHook(type="vllm", url=url, transfer="reload"),
                                     session, "t"), VllmNotifyHook)
        with pytest.raises(ValueError, match="state_dir"):
            build_hook(VllmHook(type="vllm", url=url), session, "t")


async def test_a_patch_round_names_the_patch_and_a_scheduled_full_check(tmp_path: Path) -> None:
    """With the region's patch file, the round names it (no version directory on disk yet, so
    no path), and every `full_check_every`-th update asks for the whole read-back."""
    fake = FakeBackend([True])
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    patch = tmp_path / "patches" / "v6.patch"
    patch.parent.mkdir()
    patch.write_bytes(b"x")
    cfg = VllmHook(type="vllm", url=f"http://127.0.0.1:{port}", timeout_s=10,
                   full_check_every=2)
    try:
        async with aiohttp.ClientSession() as session:
            hook = VllmBackendHook(cfg, session, tmp_path / "state")
            await hook.notify(5, tmp_path / "weights" / "v00000005", "d", patch=patch)
            first = dict(fake.update)
            await hook.notify(6, tmp_path / "weights" / "v00000006", "d", patch=patch)
    finally:
        await runner.cleanup()
    assert first["patch"] == str(patch) and "path" not in first
    assert first["full_check"] is False and fake.update["full_check"] is True
    init = fake.calls[0][2]["init_info"]
    assert init["patches_dir"] == str(patch.parent)


def test_status_shows_the_engine_check_and_when_the_full_read_back_last_ran() -> None:
    from daemon.observe.status_cli import _engine_check_line

    never = NodeStatus(node="n", engine_check=EngineCheckStatus(ok=True, last_version=3,
                                                                mode="patch", kind="incremental"))
    assert "full read-back: never" in _engine_check_line(never)[0]
    found = NodeStatus(node="n", engine_check=EngineCheckStatus(
        ok=True, last_version=3, mode="patch", full_check={
            "at": 0.0, "version": 3, "why": "requested", "ok": False, "checked": 9,
            "unreadable": 0, "mismatched": ["lm_head.weight"], "seconds": 0.1}))
    line, style = _engine_check_line(found)
    assert "(requested) v3: MISMATCH" in line and "lm_head.weight" in line and style == "red"
