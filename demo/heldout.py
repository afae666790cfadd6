"""The demo's success measure: the task's held-out problems scored on the weights a region runs.

The prompts come from the task's held-out split (`heldout_prompts()`, e.g.
rollout/tasks/arithmetic_digits.py): problems that neither the trainer's warm-up nor the
workers ever sample, so a rise is learning that carries over to unseen problems, not memory of
the training prompts. (Before, the set was drawn from the training distribution itself: every
"held-out" prompt was one of the 155 problems the workers trained on.) A fixed subset of
`prompts` of them (drawn once with `seed`) is scored twice per version: greedily (one
completion per prompt, temperature 0: the demo's success check) and at the sampling
temperature with a fixed generator seed (`samples` completions per prompt). Both are
deterministic functions of the weights. The weights are the ones a region's daemon
reconstructed and verified (`GET /v1/weights/current`), so the score is of what was delivered.
"""

import json
import random
import threading
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Score:
    version: int
    greedy: float
    """Mean task reward of the greedy completion per prompt."""
    sampled: float
    """Mean task reward over `samples` completions per prompt at the sampling temperature."""
    solved: float
    """Fraction of greedy completions with the full reward (1.0)."""

    def as_dict(self) -> dict[str, float | int]:
        return {"version": self.version, "greedy": self.greedy, "sampled": self.sampled,
                "solved": self.solved}


class NoHeldOutSplit(ValueError):
    """The task cannot say which problems training never sees; the message says what to add."""


def heldout_set(task: Any, prompts: int, seed: int) -> list[str]:
    """`prompts` distinct problems of the task's held-out split (all of them if it has fewer),
    the same for the same seed."""
    split = getattr(task, "heldout_prompts", None)
    if not callable(split):
        raise NoHeldOutSplit(
            f"task {getattr(task, 'name', task)!r} has no held-out split: the demo scores only "
            "problems training never samples, so the task needs heldout_prompts() (see "
            "rollout/tasks/arithmetic_digits.py)")
    pool = list(split())
    if not pool:
        raise NoHeldOutSplit(f"task {getattr(task, 'name', task)!r} holds out no problems")
    return pool if prompts >= len(pool) else random.Random(seed).sample(pool, prompts)


class HeldOut:
    """Scores HF weight directories on one fixed set of held-out problems with the built-in
    torch engine."""

    def __init__(self, task_spec: str, prompts: int, samples: int, seed: int, max_tokens: int,
                 temperature: float = 1.0) -> None:
        from rollout.tasks import load_task

        self.task = load_task(task_spec)
        self.prompts = heldout_set(self.task, prompts, seed)
        self.samples, self.seed = samples, seed
        self.max_tokens, self.temperature = max_tokens, temperature
        self.engine: Any = None

    def score(self, path: str | Path, version: int) -> Score:
        """Load `path` (version `version`) and score it; OSError/ValueError if it is gone or
        unreadable (a region may prune an old weight directory)."""
        if self.engine is None:
            from rollout.engine_torch import TorchEngine

            self.engine = TorchEngine()
        self.engine.load_version(path, version)
        greedy = self.engine.generate(self.prompts, 1, self.max_tokens, 0.0, self.seed)
        sampled = self.engine.generate(self.prompts, self.samples, self.max_tokens,
                                       self.temperature, self.seed)
        g = [self.task.reward(c.prompt, c.text) for c in greedy]
        s = [self.task.reward(c.prompt, c.text) for c in sampled]
        return Score(version=version, greedy=sum(g) / len(g), sampled=sum(s) / len(s),
                     solved=sum(r >= 1.0 for r in g) / len(g))


def current_weights(url: str, token: str, after: int = -1, wait_s: float = 0
                    ) -> tuple[int, str] | None:
    """(version, path) of the weights a daemon serves, waiting up to `wait_s` for one newer
    than `after`; None if it has none yet or cannot be reached."""
    req = urllib.request.Request(f"{url}/v1/weights/current?after={after}&timeout={wait_s}",
                                 headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=wait_s + 5) as r:
            body = json.loads(r.read())
    except (OSError, ValueError):
        return None
    if isinstance(body.get("version"), int) and body.get("path"):
        return body["version"], str(body["path"])
    return None


class Evaluator(threading.Thread):
    """Follows one region's current weights (long-poll) and scores v0, then every `every`
    versions, and `final`; a thread so the demo's view keeps refreshing (torch releases the
    GIL while it computes)."""

    def __init__(self, make: Callable[[], HeldOut], url: str, token: str, every: int,
                 final: int) -> None:
        super().__init__(name="heldout", daemon=True)
        self.make, self.url, self.token = make, url, token
        self.every, self.final = every, final
        self.scores: list[Score] = []
        self.prompts: list[str] = []
        self.error: str | None = None
        self.halt = threading.Event()

    def due(self, version: int) -> bool:
        if not self.scores:
            return True
        last = self.scores[-1].version
        return version > last and (version >= last + self.every or version >= self.final)

    def run(self) -> None:
        import torch

        torch.set_num_threads(1)
        try:
            heldout = self.make()
        except Exception as e:  # shown in the summary; the verdict then fails
            self.error = f"cannot build the held-out set: {e}"
            return
        self.prompts = heldout.prompts
        after = -1
        while not self.halt.is_set():
            cur = current_weights(self.url, self.token, after, wait_s=2)
            if cur is None:
                self.halt.wait(0.2)
                continue
            version, path = cur
            after = version
            if self.due(version):
                try:
                    self.scores.append(heldout.score(path, version))
                except (OSError, ValueError) as e:  # pruned before it was read: next one
                    self.error = f"v{version} not scored: {e}"
            if self.scores and self.scores[-1].version >= self.final:
                return

    def stop(self) -> None:
        self.halt.set()
        if self.ident is not None:
            self.join(timeout=10)
