"""The `deltaswarm` weight-transfer backend class in .venv-vllm, without starting a vLLM server
(tests/integration/vllm_engine_probe.py): bad requests get a clear error and change nothing,
a patch writes exactly the changed elements into the fused block, and a read-back finds one
element changed behind its back. test_vllm_swarm runs the backend inside a real `vllm serve`."""

import json
import subprocess
from pathlib import Path

import pytest

from rollout.vllm_launch import REPO, VllmLaunchConfig, build_env, write_shim

VENV = REPO / ".venv-vllm"
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not (VENV / "bin" / "python").exists(),
                       reason=f"{VENV} missing: create it with `bash tools/vllm_env.sh`"),
]


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("probe")
    env = build_env(VllmLaunchConfig(model=root), write_shim(root / "shim"))
    out = subprocess.run([str(VENV / "bin" / "python"), str(Path(__file__).with_name(
        "vllm_engine_probe.py")), str(root)], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_bad_requests_are_refused_with_the_reason(probe: dict) -> None:
    assert "mode must be one of" in probe["bad_mode"]["error"]
    assert "holds version 1, not 2" in probe["wrong_version"]["error"]
    assert "cannot patch v2 in place: the engine holds no verified version, not v1" in \
        probe["patch_unknown_base"]["error"]


@pytest.mark.parametrize(("label", "says"), [
    ("outside", "outside"), ("dotdot", "contains '..'"), ("symlink_out", "outside"),
    ("version_true", "positive integer"), ("version_zero", "positive integer"),
    ("version_negative", "positive integer"), ("move_weights_dir", "refusing to move it")])
def test_update_info_outside_the_weights_dir_or_with_a_bad_version_is_refused(
        probe: dict, label: str, says: str) -> None:
    assert says in probe[label]["error"], probe[label]


def test_a_check_reads_the_fused_block_back_and_passes_on_the_served_version(probe: dict) -> None:
    assert probe["check_v0"] == {"mode": "check", "ok": True, "mismatched": [], "loaded": 0,
                                 "ticket": "a"}


def test_a_patch_writes_exactly_the_new_version_into_the_fused_block(probe: dict) -> None:
    assert probe["patch_v1"]["mode"] == "patch" and probe["patch_v1"]["ok"] is True
    assert probe["patch_v1"]["loaded"] == 2
    assert probe["qkv_after"] == probe["qkv_v1"]


def test_an_element_changed_behind_the_engines_back_is_named(probe: dict) -> None:
    assert probe["check_after_tamper"]["ok"] is False
    assert probe["check_after_tamper"]["mismatched"] == ["attn.v_proj.weight"]
