"""TRL's GRPOTrainer trains the project's default model for a few GRPO steps on CPU with
DeltaswarmCallback publishing through a real trainer daemon; a real region daemon rebuilds every
version (v0 and one per optimizer step) bit for bit, in a directory transformers loads."""

import pytest
import torch
from transformers import AutoConfig, TrainerCallback

from chain.sources import FileSource, StateDictSource
from tests.integration.harness import Cluster
from trainer.hf_callback import DeltaswarmCallback
from trainer.model import build_default_model

trl = pytest.importorskip("trl", reason="TRL is the `trl` extra (pip install -e '.[trl]')")
datasets = pytest.importorskip("datasets", reason="TRL's datasets dependency")


class RegionCheck(TrainerCallback):
    """After each publish: wait for the region to hold that version, then compare its weight
    directory with the model's bf16 weights, tensor by tensor, bit for bit."""

    def __init__(self, cluster: Cluster, publisher) -> None:
        self.cluster, self.publisher, self.checked = cluster, publisher, []

    def _check(self, model) -> None:
        v = self.publisher.head
        self.cluster.wait_all_at(v, 60)
        cur = self.cluster.daemons["r1"].state_dir / "weights" / "current"
        got = FileSource(cur)
        want = StateDictSource({k: t.detach().to(torch.bfloat16).contiguous()
                                for k, t in model.state_dict().items()})
        assert got.names() == want.names()
        for name in want.names():
            assert (got.bits(name) == want.bits(name)).all(), (v, name)
        self.checked.append(v)

    def on_train_begin(self, args, state, control, model=None, **kw):
        self._check(model)

    def on_step_end(self, args, state, control, model=None, **kw):
        self._check(model)


def reward_length(completions, **kw):
    """Longer completions score higher: any signal makes the policy move."""
    return [len(c) / 8 for c in completions]


def grpo_setup(tmp_path, learning_rate: float):
    """A few prompts and a 3-step GRPO config small enough for CPU (this test and the LoRA one)."""
    dataset = datasets.Dataset.from_dict({"prompt": ["1+2=", "3+4=", "5+1=", "2+2="] * 4})
    args = trl.GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                          num_generations=4, max_completion_length=8, max_steps=3,
                          use_cpu=True, report_to=[], save_strategy="no",
                          learning_rate=learning_rate, bf16=False, logging_steps=1,
                          disable_tqdm=True)
    return dataset, args


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_trl_grpo_publishes_every_step_and_a_region_rebuilds_each_bit_exactly(tmp_path):
    torch.manual_seed(0)
    model, tokenizer = build_default_model(0)
    dataset, args = grpo_setup(tmp_path, learning_rate=1e-3)
    with Cluster(tmp_path / "cluster") as c:
        c.trainer()
        c.region("r1")
        c.start_all()
        pub = c.publisher()
        ours = DeltaswarmCallback(pub)
        check = RegionCheck(c, pub)
        trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_length, args=args,
                                  train_dataset=dataset, processing_class=tokenizer,
                                  callbacks=[ours, check])
        trainer.train()
        assert pub.head == 3
        assert check.checked == [0, 1, 2, 3]
        assert [p.version for p in ours.published] == [0, 1, 2, 3]
        assert all(p.notified for p in ours.published)
        assert all(p.changed_elements > 0 for p in ours.published[1:])  # the policy moved
        cur = c.daemons["r1"].state_dir / "weights" / "current"
        config = AutoConfig.from_pretrained(cur)
        assert config.dtype == torch.bfloat16 and config.architectures == ["LlamaForCausalLM"]
        assert config.use_cache
        assert (cur / "tokenizer.json").exists()
