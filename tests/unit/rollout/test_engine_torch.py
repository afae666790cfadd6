"""The built-in torch engine: sampling, recorded log-probs, and in-place version switches."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollout.engine import Engine, make_engine
from rollout.engine_torch import EngineLoadError, TorchEngine
from trainer.grpo import token_logprobs

PROMPTS = ["3+4=", "12+17=", "9-2="]


def test_greedy_batch_with_left_padding_equals_one_prompt_at_a_time(hf_versions) -> None:
    engine = TorchEngine(hf_versions[0], 0)
    batch = engine.generate(PROMPTS, 1, 5, temperature=0)
    for p, c in zip(PROMPTS, batch, strict=True):
        alone = engine.generate([p], 1, 5, temperature=0)[0]
        assert c.token_ids == alone.token_ids
        assert c.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_sampling_is_seeded_prompt_major_and_tagged_with_version(hf_versions) -> None:
    engine = make_engine("torch", path=str(hf_versions[0]), version=7)
    assert isinstance(engine, Engine)
    a = engine.generate(PROMPTS, 4, 6, temperature=1.0, seed=3)
    b = engine.generate(PROMPTS, 4, 6, temperature=1.0, seed=3)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.prompt for c in a] == [p for p in PROMPTS for _ in range(4)]
    assert all(c.version == 7 and len(c.logprobs) == len(c.token_ids) for c in a)
    assert all(lp <= 0 for c in a for lp in c.logprobs)
    eos = engine.tokenizer.eos_token_id
    for c in a:
        assert (c.finish_reason == "stop") == (c.token_ids[-1] == eos)
        assert eos not in c.token_ids[:-1]
    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("nope")


def test_recorded_logprobs_equal_the_trainers_recomputation(hf_versions) -> None:
    engine = TorchEngine(hf_versions[0], 0)
    comps = engine.generate(PROMPTS, 3, 6, temperature=1.0, seed=11)
    model = engine.model
    with torch.no_grad():
        logp, _, _ = token_logprobs(model, [c.prompt_ids for c in comps],
                                       [c.token_ids for c in comps],
                                       engine.tokenizer.pad_token_id)
    for i, c in enumerate(comps):
        assert logp[i, :len(c.token_ids)].tolist() == pytest.approx(c.logprobs, abs=1e-4)


def test_load_version_copies_weights_into_the_same_module(hf_versions) -> None:
    engine = TorchEngine(hf_versions[0], 0)
    module = engine.model
    before = engine.generate(PROMPTS, 2, 5, temperature=1.0, seed=1)
    engine.load_version(hf_versions[1], 1)
    assert engine.model is module and engine.version == 1
    want = load_file(str(Path(hf_versions[1]) / "model.safetensors"))
    got = engine.model.state_dict()
    assert all(torch.equal(got[k], want[k].float()) for k in want)
    after = engine.generate(PROMPTS, 2, 5, temperature=1.0, seed=1)
    assert all(c.version == 1 for c in after)
    assert [c.logprobs for c in after] != [c.logprobs for c in before]


def test_load_version_refuses_a_directory_that_does_not_fit(hf_versions, tmp_path) -> None:
    engine = TorchEngine(hf_versions[0], 0)
    with pytest.raises(EngineLoadError, match=r"no config\.json"):
        engine.load_version(tmp_path, 1)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(EngineLoadError, match=r"no \*\.safetensors"):
        engine.load_version(tmp_path, 1)
    assert engine.version == 0
