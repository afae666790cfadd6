"""Verifiable tasks as plug-ins: the `Task` protocol and `load_task(spec)`.

Both the rollout worker (to sample and score) and the trainer (for the warm-up references)
load a task from the same spec string, so a user task never needs code in either package.

Spec forms:
  `pkg.module` or `pkg.module:attr`   attr (default `make_task`, else `task`) is a Task or a
                                      zero-argument callable returning one.
  `file:PROMPTS.jsonl:MODULE:FUNC`    prompts from a JSONL file, one object per line with
                                      "prompt" (str) and optionally "reference" (str) plus any
                                      fields the scorer needs; reward = FUNC(prompt, completion,
                                      record) -> float, MODULE a dotted import path or a .py file.
"""

import importlib
import importlib.util
import json
import random
import sys
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


class TaskSpecError(ValueError):
    """A task spec, prompts file or reward function that cannot be used; the message says why."""


@runtime_checkable
class Task(Protocol):
    name: str

    def sample_prompts(self, rng: random.Random, n: int) -> list[str]: ...

    def reward(self, prompt: str, completion: str) -> float: ...

    def reference(self, prompt: str) -> str | None: ...


class FileTask:
    """Prompts from a JSONL file, scored by a user function."""

    def __init__(self, path: str | Path, reward_fn: Any, name: str | None = None) -> None:
        self.records = _read_prompts(Path(path))
        self.by_prompt = {r["prompt"]: r for r in self.records}
        self.reward_fn = reward_fn
        self.name = name or f"file:{Path(path).name}"

    def sample_prompts(self, rng: random.Random, n: int) -> list[str]:
        return [rng.choice(self.records)["prompt"] for _ in range(n)]

    def reward(self, prompt: str, completion: str) -> float:
        record = self.by_prompt.get(prompt, {"prompt": prompt})
        value = self.reward_fn(prompt, completion, record)
        try:
            return float(value)
        except (TypeError, ValueError) as e:
            raise TaskSpecError(
                f"reward function {self.reward_fn!r} returned {value!r}, not a number"
            ) from e

    def reference(self, prompt: str) -> str | None:
        ref = self.by_prompt.get(prompt, {}).get("reference")
        return ref if isinstance(ref, str) else None


def load_task(spec: str) -> Task:
    if spec.startswith("file:"):
        parts = spec[len("file:"):].rsplit(":", 2)
        if len(parts) != 3 or not all(parts):
            raise TaskSpecError(
                f"task spec {spec!r}: expected file:PROMPTS.jsonl:MODULE:FUNC "
                "(e.g. file:prompts.jsonl:mytask.score:reward)"
            )
        path, module_name, func_name = parts
        fn = getattr(_import(module_name, spec), func_name, None)
        if not callable(fn):
            raise TaskSpecError(f"task spec {spec!r}: {module_name} has no function {func_name}")
        return FileTask(path, fn)
    module_name, _, attr = spec.partition(":")
    module = _import(module_name, spec)
    names = [attr] if attr else ["make_task", "task"]
    for name in names:
        obj = getattr(module, name, None)
        if obj is None:
            continue
        is_factory = isinstance(obj, type) or (callable(obj) and not isinstance(obj, Task))
        task = obj() if is_factory else obj
        if not isinstance(task, Task):
            raise TaskSpecError(
                f"task spec {spec!r}: {module_name}.{name} is not a Task "
                "(needs name, sample_prompts, reward, reference)"
            )
        return task
    raise TaskSpecError(f"task spec {spec!r}: module {module_name} defines none of {names}")


def _import(module_name: str, spec: str) -> Any:
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise TaskSpecError(f"task spec {spec!r}: no such file {path}")
        mod_spec = importlib.util.spec_from_file_location(f"_task_{path.stem}", path)
        if mod_spec is None or mod_spec.loader is None:
            raise TaskSpecError(f"task spec {spec!r}: cannot load {path} as a module")
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[mod_spec.name] = module
        mod_spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise TaskSpecError(f"task spec {spec!r}: cannot import {module_name}: {e}") from e


def _read_prompts(path: Path) -> list[dict]:
    if not path.is_file():
        raise TaskSpecError(f"prompts file {path} does not exist")
    records = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskSpecError(f"{path}:{lineno}: not JSON ({e.msg})") from e
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise TaskSpecError(f'{path}:{lineno}: needs an object with a string "prompt"')
        records.append(record)
    if not records:
        raise TaskSpecError(f"prompts file {path} has no prompts")
    return records
