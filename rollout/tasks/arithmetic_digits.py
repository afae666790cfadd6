"""Two-digit additions and subtractions that need no carry or borrow ("23+45=", "87-52="), with
a fixed held-out split that the warm-up and the workers never sample: the demo's test of
whether RL improved the policy rather than its memory of the prompts it trained on.

Why this family: every digit of an answer is a one-digit fact about the digits above it (2+4,
3+5), so a problem the policy never saw is made of facts it practised in others. The default
model, warmed up on the training split only, scores the same on held-out problems as on
training ones. One-digit problems (`rollout.tasks.arithmetic`) have no such structure: each is
its own fact, and the same model trained on 80 % of the 155 of them scored 0-16 % on the rest.

The split: a problem is held out when the crc32 of its prompt, mod 100, is below
`heldout_percent` (crc32 rather than `hash()`, which Python salts per process: the trainer,
every worker and the demo must agree). `sample_prompts`, the only prompt source of the warm-up
(trainer/warmup.py) and of the rollout workers, draws from the training split only;
`heldout_prompts` lists the rest.

Reward and references are `Arithmetic`'s (exact 1.0, partial credit for length and digits).
"""

import random
import zlib
from dataclasses import dataclass, field

from rollout.tasks.arithmetic import Arithmetic


def problems(op: str) -> list[str]:
    """Every prompt of operator `op` ("+" or "-") with both operands in 10-99 and no carry
    (each digit sum <= 9) or borrow (each digit of the first >= the second's), ascending."""
    out = []
    for a in range(10, 100):
        for b in range(10, 100):
            pairs = zip(divmod(a, 10), divmod(b, 10), strict=True)
            if op == "+" and all(x + y <= 9 for x, y in pairs):
                out.append(f"{a}+{b}=")
            elif op == "-" and all(x >= y for x, y in pairs):
                out.append(f"{a}-{b}=")
    return out


def held_out(prompt: str, percent: int) -> bool:
    """Whether `prompt` belongs to the held-out split (the same answer in every process)."""
    return zlib.crc32(prompt.encode()) % 100 < percent


@dataclass
class DigitArithmetic(Arithmetic):
    ops: str = "+-"
    heldout_percent: int = 20
    """Share of the problems (by prompt hash) that training never sees."""
    name: str = "arithmetic-digits"
    _train: dict[str, list[str]] = field(init=False, repr=False)
    _heldout: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.heldout_percent < 100:
            raise ValueError(f"heldout_percent must be in 1-99, got {self.heldout_percent}")
        if not self.ops or set(self.ops) - {"+", "-"}:
            raise ValueError(f"ops must be made of '+' and '-', got {self.ops!r}")
        self.max_operand = 99
        every = {op: problems(op) for op in dict.fromkeys(self.ops)}
        self._train = {op: [p for p in ps if not held_out(p, self.heldout_percent)]
                       for op, ps in every.items()}
        self._heldout = [p for ps in every.values() for p in ps
                         if held_out(p, self.heldout_percent)]

    def sample_prompts(self, rng: random.Random, n: int) -> list[str]:
        """`n` training problems: an operator uniformly, then a problem of it uniformly."""
        return [rng.choice(self._train[rng.choice(self.ops)]) for _ in range(n)]

    def heldout_prompts(self) -> list[str]:
        """Every held-out problem, in a fixed order."""
        return list(self._heldout)

    def training_prompts(self) -> list[str]:
        """Every problem `sample_prompts` can return, in a fixed order."""
        return [p for ps in self._train.values() for p in ps]


def make_task() -> DigitArithmetic:
    return DigitArithmetic()
