"""The arithmetic task's rewards and the task plug-in loader's spec forms and errors."""

import json
import random
from pathlib import Path

import pytest

from rollout.tasks import FileTask, Task, TaskSpecError, load_task
from rollout.tasks.arithmetic import Arithmetic


def test_arithmetic_reward_is_one_for_exact_partial_for_close_zero_for_junk() -> None:
    t = Arithmetic()
    assert t.reference("12+7=") == "19" and t.reference("15-9=") == "6"
    assert t.reward("12+7=", "19") == 1.0
    assert t.reward("12+7=", " 19 ") == 1.0
    assert 0 < t.reward("12+7=", "18") < 1.0
    assert t.reward("12+7=", "18") > t.reward("12+7=", "28") > 0
    assert t.reward("12+7=", "x9") == 0.0 and t.reward("12+7=", "") == 0.0


def test_arithmetic_prompts_are_seeded_and_answers_non_negative() -> None:
    t = Arithmetic()
    a, b = t.sample_prompts(random.Random(1), 50), t.sample_prompts(random.Random(1), 50)
    assert a == b
    assert all(int(t.reference(p)) >= 0 for p in a)


def test_module_spec_loads_the_default_task() -> None:
    task = load_task("rollout.tasks.arithmetic")
    assert isinstance(task, Task) and task.name == "arithmetic"
    assert isinstance(load_task("rollout.tasks.arithmetic:Arithmetic"), Arithmetic)


def test_file_spec_loads_prompts_and_a_reward_function_from_a_py_file(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "capital of france?", "reference": "paris", "answer": "paris"},
        {"prompt": "2*3=", "answer": "6"},
    ]) + "\n")
    scorer = tmp_path / "score.py"
    scorer.write_text("def reward(prompt, completion, record):\n"
                      "    return 1.0 if completion.strip() == record['answer'] else 0.0\n")
    task = load_task(f"file:{prompts}:{scorer}:reward")
    assert isinstance(task, FileTask)
    assert task.reward("2*3=", "6") == 1.0 and task.reward("2*3=", "5") == 0.0
    assert task.reference("capital of france?") == "paris" and task.reference("2*3=") is None
    assert set(task.sample_prompts(random.Random(0), 20)) == {"capital of france?", "2*3="}


def test_bad_specs_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(TaskSpecError, match="cannot import"):
        load_task("no.such.module")
    with pytest.raises(TaskSpecError, match="expected file:PROMPTS"):
        load_task("file:prompts.jsonl")
    with pytest.raises(TaskSpecError, match="does not exist"):
        load_task(f"file:{tmp_path}/missing.jsonl:rollout.tasks.arithmetic:make_task")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(TaskSpecError, match=r"bad\.jsonl:2"):
        load_task(f"file:{bad}:rollout.tasks.arithmetic:make_task")
    with pytest.raises(TaskSpecError, match="no function nope"):
        load_task(f"file:{bad}:rollout.tasks.arithmetic:nope")
    with pytest.raises(TaskSpecError, match="not a Task"):
        load_task("rollout.tasks.arithmetic:random")
