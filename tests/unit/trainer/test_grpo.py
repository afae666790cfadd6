"""GRPO pieces against hand computations, and one real step on the default model."""

import math

import pytest
import torch

from trainer.grpo import (
    GRPOConfig,
    GRPOTrainer,
    bf16_changed_fraction,
    group_advantages,
    tis_loss,
    token_logprobs,
)
from trainer.model import build_default_model
from trainer.staleness import filter_stale


def test_group_advantages_normalise_within_each_group() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 0.5, 3.0, 3.0], list("aaaabcc"), eps=0.0)
    assert adv[:4].tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0])
    assert adv[4:].tolist() == [0.0, 0.0, 0.0]
    adv = group_advantages([2.0, 0.0, 1.0], ["g", "g", "g"], eps=0.0)
    std = math.sqrt(2 / 3)
    assert adv.tolist() == pytest.approx([1 / std, -1 / std, 0.0])


def test_truncated_is_loss_matches_hand_computation() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.3], [-0.5, -1.0, 0.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.5, -1.0, -3.0], [-0.5, -0.2, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([2.0, -1.0])
    loss, stats = tis_loss(logp, behaviour, adv, mask, cap=2.0)
    rows = [((-1.0, -1.5), (-2.0, -1.0), (-0.3, -3.0)), ((-0.5, -0.5), (-1.0, -0.2))]
    weights, total = [], 0.0
    for a, row in zip((2.0, -1.0), rows, strict=True):
        for lp, b in row:
            w = min(math.exp(lp - b), 2.0)
            weights.append(w)
            total += -w * a * lp
    assert loss.item() == pytest.approx(total / 5, rel=1e-6)
    loss.backward()
    expect = [[-weights[0] * 2 / 5, -weights[1] * 2 / 5, -weights[2] * 2 / 5],
              [weights[3] / 5, weights[4] / 5, 0.0]]
    assert logp.grad.tolist() == [pytest.approx(r, rel=1e-6) for r in expect]
    assert stats["is_clipped_frac"] == pytest.approx(1 / 5)
    ratios = [math.exp(lp - b) for row in rows for lp, b in row]
    kl = sum(r - 1 - math.log(r) for r in ratios) / 5
    assert stats["kl_behaviour"] == pytest.approx(kl, rel=1e-5)


def test_staleness_filter_counts_stale_and_future() -> None:
    trajs = [{"version": v} for v in (10, 9, 8, 7, 5, 11, 10)]
    rep = filter_stale(trajs, trainer_version=10, max_staleness=2)
    assert [t["version"] for t in rep.kept] == [10, 9, 8, 10]
    assert (rep.dropped_stale, rep.dropped_future) == (2, 1)
    assert rep.histogram == {0: 2, 1: 1, 2: 1}
    with pytest.raises(ValueError, match="max_staleness"):
        filter_stale(trajs, 10, -1)


def test_bf16_changed_fraction_counts_bit_pattern_changes() -> None:
    old = {"a": torch.tensor([1.0, 2.0, 3.0, 4.0]).bfloat16(), "b": torch.zeros(4).bfloat16()}
    new = {"a": torch.tensor([1.0, 2.015625, 3.0, 4.0]).bfloat16(),
           "b": torch.tensor([0.0, -0.0, 0.0, 0.0]).bfloat16()}
    assert bf16_changed_fraction(old, new) == 2 / 8


def _trajectories(model: torch.nn.Module, tok, version: int) -> list[dict]:
    prompt = tok("3+4=")["input_ids"]
    good = tok("7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    bad = tok("9", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    with torch.no_grad():
        lp, _, _ = token_logprobs(model, [prompt, prompt], [good, bad], tok.pad_token_id)
    return [
        {"id": f"{i}", "version": version, "group": "g", "prompt_ids": prompt,
         "completion_ids": ids, "logprobs": lp[i, :len(ids)].tolist(), "reward": r}
        for i, (ids, r) in enumerate([(good, 1.0), (bad, 0.0)])
    ]


def test_step_raises_logprob_of_rewarded_completion_and_bumps_version() -> None:
    model, tok = build_default_model(seed=0)
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-3), version=5, pad_id=tok.pad_token_id)
    trajs = _trajectories(model, tok, version=5)
    before = [sum(t["logprobs"]) for t in trajs]
    metrics = trainer.step([*trajs, dict(trajs[0], id="old", version=0)])
    assert metrics["stepped"] and trainer.version == 6 and metrics["version"] == 6
    assert metrics["dropped_stale"] == 1 and metrics["kept"] == 2
    assert metrics["is_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert 0 < metrics["bf16_changed_frac"] <= 1
    after = [sum(t["logprobs"]) for t in _trajectories(model, tok, 6)]
    assert after[0] > before[0] and after[1] < before[1]


def test_step_with_nothing_fresh_takes_no_step() -> None:
    model, tok = build_default_model(seed=0)
    trainer = GRPOTrainer(model, GRPOConfig(max_staleness=1), version=9, pad_id=tok.pad_token_id)
    snapshot = trainer.state_dict_bf16()
    metrics = trainer.step([dict(t, version=3) for t in _trajectories(model, tok, 3)])
    assert not metrics["stepped"] and metrics["dropped_stale"] == 2 and trainer.version == 9
    assert bf16_changed_fraction(snapshot, trainer.state_dict_bf16()) == 0.0


def test_checkpoint_round_trip_restores_weights_optimizer_and_version(tmp_path) -> None:
    model, tok = build_default_model(seed=0)
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-3), pad_id=tok.pad_token_id)
    trainer.step(_trajectories(model, tok, 0))
    trainer.save_checkpoint(tmp_path / "ckpt.pt")
    other_model, _ = build_default_model(seed=1)
    other = GRPOTrainer(other_model, GRPOConfig(lr=1e-3), pad_id=tok.pad_token_id)
    other.load_checkpoint(tmp_path / "ckpt.pt")
    assert other.version == 1
    assert bf16_changed_fraction(trainer.state_dict_bf16(), other.state_dict_bf16()) == 0.0
    trajs = _trajectories(model, tok, 1)
    trainer.step(trajs)
    other.step(trajs)
    for a, b in zip(model.parameters(), other_model.parameters(), strict=True):
        assert torch.equal(a, b)
