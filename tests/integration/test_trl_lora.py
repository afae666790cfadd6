"""TRL's GRPOTrainer with a PEFT LoRA on CPU: the base goes out once, the adapter every step,
through real daemons into a stock `vllm serve --enable-lora`.

The base chain's v0 is the model before training (trainer/lora.py publish_base), followed by a
base region daemon that vLLM is started on. The run's DeltaswarmCallback publishes the adapter
as PEFT saves it, pinned to that base; the run's region daemon rebuilds each version and its
`vllm_lora` hook loads it under the run's name. After every optimizer step: the region's
adapter equals the live PEFT model's adapter bit for bit, and vLLM's greedy tokens (and
log-probs) for the run's name equal the built-in engine's on base + that adapter.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from chain.adapters import ADAPTER_WEIGHTS
from rollout.engine_torch import TorchEngine
from rollout.vllm_launch import REPO, VllmLaunchConfig, VllmServer, start
from rollout.vllm_server import VllmServerHook
from tests.integration.harness import Cluster, Daemon
from tests.integration.test_lora_swarm import MAX_TOKENS, PROMPTS, TARGETS, wait_adapter
from tests.integration.test_trl_callback import grpo_setup, reward_length
from trainer.hf_callback import DeltaswarmCallback
from trainer.lora import adapter_state, publish_base
from trainer.model import build_default_model

VENV = REPO / ".venv-vllm"
trl = pytest.importorskip("trl", reason="TRL is the `trl` extra (pip install -e '.[trl]')")
peft = pytest.importorskip("peft", reason="PEFT is the `trl` extra (pip install -e '.[trl]')")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not (VENV / "bin" / "vllm").exists(),
                       reason=f"{VENV} missing: create it with `bash tools/vllm_env.sh`"),
]


class ServedCheck(TrainerCallback):
    """After each publish (DeltaswarmCallback runs first): vLLM serves exactly that adapter."""

    def __init__(self, publisher, region: Daemon, url: str, base_dir: Path) -> None:
        self.publisher, self.region, self.url = publisher, region, url
        self.engine = TorchEngine(str(base_dir), 0)
        self.tokens: dict[int, list[list[int]]] = {}

    def _check(self, model) -> None:
        v = self.publisher.head
        wait_adapter(self.region, v)
        peft_dir = self.region.state_dir / "lora" / "grpo-lora" / f"v{v:08d}"
        got = load_file(str(peft_dir / ADAPTER_WEIGHTS))
        live = adapter_state(model)
        assert set(got) == set(live) and all(torch.equal(got[k], live[k]) for k in live), v
        self.engine.load_adapter(peft_dir, v)
        want = [self.engine.generate([p], n=1, max_tokens=MAX_TOKENS, temperature=0.0)[0]
                for p in PROMPTS]
        served = asyncio.run(VllmServerHook(self.url, model="grpo-lora").generate(
            PROMPTS, max_tokens=MAX_TOKENS, temperature=0.0))
        assert [s.token_ids for s in served] == [w.token_ids for w in want], v
        for s, w in zip(served, want, strict=True):
            assert s.logprobs == pytest.approx(w.logprobs, abs=1e-3)
        self.tokens[v] = [s.token_ids for s in served]

    def on_train_begin(self, args, state, control, model=None, **kw):
        self._check(model)

    def on_step_end(self, args, state, control, model=None, **kw):
        self._check(model)


@pytest.mark.timeout(600)
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_trl_grpo_with_lora_publishes_adapters_that_vllm_serves_as_torch_computes(tmp_path):
    torch.manual_seed(0)
    model, tokenizer = build_default_model(0)
    dataset, args = grpo_setup(tmp_path, learning_rate=2e-2)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    server: VllmServer | None = None
    with Cluster(tmp_path / "base", run="base") as base, \
            Cluster(tmp_path / "run", run="grpo-lora") as run:
        try:
            base.trainer()
            base_region = base.region("base-r")
            base.start_all()
            pin = publish_base(base.publisher(), model, tokenizer)
            base.wait_all_at(0, 60)
            weights = base_region.state_dir / "weights"
            base_dir = (weights / "current").resolve()
            server = start(VllmLaunchConfig(model=base_dir, transfer_backend=None,
                                            dtype="float32", max_model_len=64,
                                            max_lora_rank=8, max_loras=2),
                           log_path=tmp_path / "vllm.log")
            region = run.lora_run("grpo-lora", weights, server.base_url)
            pub = run.publisher()
            pub.base = pin
            ours = DeltaswarmCallback(pub)
            check = ServedCheck(pub, region, server.base_url, base_dir)
            trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_length, args=args,
                                      train_dataset=dataset, processing_class=tokenizer,
                                      peft_config=lora, callbacks=[ours, check])
            trainer.train()
            assert pub.head == 3 and sorted(check.tokens) == [0, 1, 2, 3]
            assert all(p.notified for p in ours.published)
            assert all(m.base == pin for m in pub.store.manifests().values())
            # only the adapter travels: every version is a small fraction of the base
            assert all(p.dense_bytes < pin_bytes(base) / 10 for p in ours.published)
            assert all(p.changed_elements > 0 for p in ours.published[1:])  # it trained
        finally:
            if server is not None:
                server.stop()


def pin_bytes(base: Cluster) -> int:
    """Bytes of the base version's tensors (its snapshot's dense size)."""
    return base.publisher().store.get(0, "snapshot").stats["dense_bytes"]
