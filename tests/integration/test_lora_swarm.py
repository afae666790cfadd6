"""Two LoRA runs over one base, through real daemons, into one stock `vllm serve --enable-lora`.

The base model is an ordinary chain (one snapshot) followed by a base region daemon; vLLM is
started on that daemon's reconstructed directory. Each run has its own trainer key, trainer
daemon and region daemon (`adapter.base_weights` = the base daemon's weights, engine
`vllm_lora`), and publishes PEFT adapter versions pinned to the base's digest. After every
version, vLLM's greedy tokens for the run's name equal the built-in engine's on base + that
adapter (rollout/lora_merge.py), both runs are served side by side, and status shows each run's
adapter version. Then a run publishes an adapter pinned to a base the region does not hold: it
is refused before any block is fetched, with the reason in status, and vLLM keeps serving the
last good adapter.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file

from chain.adapters import ADAPTER_WEIGHTS, pin_for
from daemon.engines.lora import versions_listed
from rollout.engine import Completion
from rollout.engine_torch import TorchEngine
from rollout.vllm_launch import REPO, VllmLaunchConfig, VllmServer, start
from rollout.vllm_server import VllmServerHook
from tests.integration.harness import Cluster, Daemon
from trainer.lora import adapter_files, adapter_state, base_state
from trainer.model import build_default_model, hf_files

VENV = REPO / ".venv-vllm"
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not (VENV / "bin" / "vllm").exists(),
                       reason=f"{VENV} missing: create it with `bash tools/vllm_env.sh`"),
]

PROMPTS = ["12+7=", "what is 3*4?", "(5-2)*9=", "hello, world."]
MAX_TOKENS = 12
RANK = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(seed: int) -> torch.nn.Module:
    """The default model wrapped in a LoRA whose B is not zero (so the adapter shows)."""
    model, _ = build_default_model()
    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS,
                                            init_lora_weights=False))


def trained(adapter: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The next version: every adapter weight moves a little (LoRA changes densely)."""
    g = torch.Generator().manual_seed(100 + seed)
    return {k: (v.float() + torch.randn(v.shape, generator=g) * v.float().std() * 0.5)
            .bfloat16() for k, v in adapter.items()}


def greedy(hook: VllmServerHook) -> list[Completion]:
    return asyncio.run(hook.generate(PROMPTS, max_tokens=MAX_TOKENS, temperature=0.0))


def reference(engine: TorchEngine, peft_dir: Path, version: int) -> list[Completion]:
    engine.load_adapter(peft_dir, version)
    return [engine.generate([p], n=1, max_tokens=MAX_TOKENS, temperature=0.0)[0]
            for p in PROMPTS]


def wait_adapter(region: Daemon, version: int, timeout: float = 120) -> dict:
    """Until the region's vllm_lora hook reports `version` loaded into vLLM."""
    deadline, adapter = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        if region.proc is not None and region.proc.poll() is not None:
            raise AssertionError(f"{region.name} exited:\n{region.log()}")
        adapter = region.status().get("adapter") or {}
        if adapter.get("engine_version") == version:
            return adapter
        time.sleep(0.3)
    raise AssertionError(f"{region.name} never served adapter v{version}: {adapter}\n"
                         f"{region.log()}")


def test_two_lora_runs_share_one_base_and_one_vllm_server(tmp_path: Path) -> None:
    model, tokenizer = build_default_model()
    server: VllmServer | None = None
    with Cluster(tmp_path / "base", run="base") as base, \
            Cluster(tmp_path / "run-a", run="run-a") as run_a, \
            Cluster(tmp_path / "run-b", run="run-b") as run_b:
        try:
            base.trainer()
            base_region = base.region("base-r")
            base.start_all()
            snapshot = base.publisher().publish(0, base_state(model),
                                                hf_files(model, tokenizer)).snapshot
            base.wait_all_at(0, 60)
            base_weights = base_region.state_dir / "weights"
            base_dir = (base_weights / "current").resolve()
            # float32 serving: vLLM applies LoRA unmerged, and in bf16 its log-probs drift ~1e-2
            # from any torch reference; in fp32 they agree to ~1e-6 (tokens agree in both)
            server = start(VllmLaunchConfig(model=base_dir, transfer_backend=None,
                                            dtype="float32", max_model_len=64,
                                            max_lora_rank=RANK, max_loras=2),
                           log_path=tmp_path / "vllm.log")
            runs = {"run-a": run_a, "run-b": run_b}
            regions, adapters, files = {}, {}, {}
            for seed, (name, c) in enumerate(runs.items(), start=1):
                regions[name] = c.lora_run(name, base_weights, server.base_url)
                c.publisher().base = pin_for(snapshot)
                peft = lora_model(seed)
                adapters[name], files[name] = adapter_state(peft), adapter_files(peft)
            engines = {name: TorchEngine(str(base_dir), 0) for name in runs}
            base_tokens = [c.token_ids for c in greedy(VllmServerHook(server.base_url))]
            seen: dict[str, list] = {name: [] for name in runs}
            for version in range(3):
                for name, c in runs.items():
                    if version:
                        adapters[name] = trained(adapters[name], version)
                    assert c.publisher().publish(version, adapters[name], files[name]).notified
                for name, region in regions.items():
                    status = wait_adapter(region, version)
                    assert status["base"]["state_digest"] == snapshot.state_digest
                    assert status["base_problem"] is None
                    peft_dir = Path(region.state_dir / "lora" / name / f"v{version:08d}")
                    got_adapter = load_file(str(peft_dir / ADAPTER_WEIGHTS))  # what was sent
                    assert got_adapter.keys() == adapters[name].keys() and all(
                        torch.equal(got_adapter[k], adapters[name][k]) for k in got_adapter)
                    want = reference(engines[name], peft_dir, version)
                    served = greedy(VllmServerHook(server.base_url, model=name))
                    got = [c.token_ids for c in served]
                    assert got == [w.token_ids for w in want], \
                        f"{name} v{version}: vLLM {got} != torch {[w.token_ids for w in want]}"
                    for s, w in zip(served, want, strict=True):
                        assert s.logprobs == pytest.approx(w.logprobs, abs=1e-3)
                    seen[name].append(got)
            # one server, both runs at once, each at its newest adapter: vLLM's model list, and
            # each region's status (which lists what vLLM held at its own last load)
            with urllib.request.urlopen(server.base_url + "/v1/models", timeout=30) as r:
                listed = versions_listed(json.loads(r.read()))
            assert {k: listed.get(k) for k in runs} == {"run-a": 2, "run-b": 2}, listed
            for name, region in regions.items():
                adapter = region.status()["adapter"]
                assert adapter["lora_name"] == name and adapter["engine_version"] == 2
                assert adapter["engine_adapters"][name] == 2
            assert seen["run-a"] != seen["run-b"], "two different adapters served alike"
            assert all(any(s != base_tokens for s in seen[n]) for n in runs), \
                "an adapter never changed what the base generates"
            # an adapter trained on a base this region does not hold is refused before download
            foreign = pin_for(snapshot).model_copy(update={"version": 7,
                                                           "state_digest": "cd" * 16})
            run_a.publisher().base = foreign
            assert run_a.publisher().publish(3, trained(adapters["run-a"], 3),
                                             files["run-a"]).notified
            region = regions["run-a"]
            deadline, adapter = time.monotonic() + 60, {}
            while time.monotonic() < deadline:
                adapter = region.status()["adapter"]
                if adapter["base_problem"]:
                    break
                time.sleep(0.3)
            assert "base v7 (digest cdcdcdcdcdcd…), which this region does not hold" in \
                (adapter["base_problem"] or ""), adapter
            status = region.status()
            assert status["current_version"] == 2 and adapter["engine_version"] == 2
            fetched = [t for t in status["versions"]
                       if t["artifact"] == "v00000003.delta" and t["done_bytes"]]
            assert fetched == [], f"blocks of the refused adapter were fetched: {fetched}"
            assert [c.token_ids for c in greedy(VllmServerHook(server.base_url, model="run-a"))] \
                == seen["run-a"][-1]
        finally:
            if server is not None:
                server.stop()
