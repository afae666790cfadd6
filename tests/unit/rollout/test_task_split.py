"""The digit-wise arithmetic task's held-out split: disjoint from every prompt training can
draw (the workers' and the warm-up's), the same in every process, and made of the same kind of
problem as the training split."""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from demo.heldout import NoHeldOutSplit, heldout_set
from rollout.tasks import Task, load_task
from rollout.tasks.arithmetic import Arithmetic
from rollout.tasks.arithmetic_digits import DigitArithmetic, problems

ROOT = Path(__file__).resolve().parents[3]


def test_the_split_is_disjoint_from_every_training_prompt_and_covers_the_family() -> None:
    task = DigitArithmetic()
    heldout = set(task.heldout_prompts())
    train = set(task.training_prompts())
    assert heldout and train and not heldout & train
    assert heldout | train == set(problems("+")) | set(problems("-"))
    assert 0.15 < len(heldout) / (len(heldout) + len(train)) < 0.25  # heldout_percent 20
    # what the workers and the warm-up draw (sample_prompts) is never held out, and reaches
    # (nearly) every training problem, so the split is not an accident of a narrow sampler
    drawn = set()
    for seed in range(5):
        drawn.update(task.sample_prompts(random.Random(seed), 20_000))
    assert not drawn & heldout
    assert len(drawn) > 0.99 * len(train)


def test_the_warm_up_trains_on_no_held_out_problem() -> None:
    from trainer.model import build_default_model
    from trainer.warmup import warmup

    task = DigitArithmetic()
    seen: list[str] = []

    class Recording:
        name = task.name
        reference = staticmethod(task.reference)

        @staticmethod
        def sample_prompts(rng: random.Random, n: int) -> list[str]:
            out = task.sample_prompts(rng, n)
            seen.extend(out)
            return out

    model, tokenizer = build_default_model(0, hidden=16, layers=1, heads=2)
    warmup(model, tokenizer, Recording(), steps=3, batch=32)
    assert len(seen) == 96 and not set(seen) & set(task.heldout_prompts())


def test_problems_need_no_carry_or_borrow_and_score_like_arithmetic() -> None:
    task = load_task("rollout.tasks.arithmetic_digits")
    assert isinstance(task, Task) and task.name == "arithmetic-digits"
    for prompt in task.heldout_prompts() + task.training_prompts():
        a, op, b = prompt[:2], prompt[2], prompt[3:5]
        answer = task.reference(prompt)
        digits = [int(x) + int(y) if op == "+" else int(x) - int(y)
                  for x, y in zip(a, b, strict=True)]
        assert all(0 <= d <= 9 for d in digits), prompt
        assert int(answer) == 10 * digits[0] + digits[1], prompt
        assert task.reward(prompt, answer) == 1.0
    assert task.reward("23+45=", "68") == 1.0 and 0 < task.reward("23+45=", "67") < 1.0


def test_every_process_agrees_on_the_split() -> None:
    """crc32, not the per-process salted hash(): a worker started with another hash seed must
    hold out exactly the same problems as the demo that scores them."""
    code = ("from rollout.tasks.arithmetic_digits import DigitArithmetic;"
            "print(','.join(DigitArithmetic().heldout_prompts()))")
    outs = {subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                           text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed,
                                "PYTHONPATH": str(ROOT)}).stdout.strip()
            for seed in ("1", "2")}
    assert outs == {",".join(DigitArithmetic().heldout_prompts())}


def test_the_demo_scores_a_fixed_subset_of_the_split_and_refuses_a_task_without_one() -> None:
    task = DigitArithmetic()
    subset = heldout_set(task, 100, seed=7)
    assert len(set(subset)) == 100 and set(subset) <= set(task.heldout_prompts())
    assert subset == heldout_set(task, 100, seed=7) != heldout_set(task, 100, seed=8)
    assert heldout_set(task, 10**6, seed=7) == task.heldout_prompts()
    with pytest.raises(NoHeldOutSplit, match="no held-out split"):
        heldout_set(Arithmetic(), 10, seed=0)


def test_bad_split_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="heldout_percent"):
        DigitArithmetic(heldout_percent=0)
    with pytest.raises(ValueError, match="ops"):
        DigitArithmetic(ops="*")
