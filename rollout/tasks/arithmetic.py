"""The default task: integer arithmetic prompts like "12+7=" with a verifiable reward.

Reward is 1.0 for the exact answer and partial credit otherwise (0.2 for the right number of
digits, up to 0.3 more for digits right in place), so a tiny policy gets a graded signal.
"""

import random
from dataclasses import dataclass


@dataclass
class Arithmetic:
    max_operand: int = 9
    ops: str = "+-"
    name: str = "arithmetic"

    def sample_prompts(self, rng: random.Random, n: int) -> list[str]:
        out = []
        for _ in range(n):
            op = rng.choice(self.ops)
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            if op == "-" and b > a:
                a, b = b, a
            out.append(f"{a}{op}{b}=")
        return out

    def reference(self, prompt: str) -> str | None:
        parsed = _parse(prompt)
        if parsed is None:
            return None
        a, op, b = parsed
        return str(a + b if op == "+" else a - b if op == "-" else a * b)

    def reward(self, prompt: str, completion: str) -> float:
        answer = self.reference(prompt)
        got = completion.strip()
        if answer is None or not got:
            return 0.0
        if got == answer:
            return 1.0
        if not got.lstrip("-").isdigit():
            return 0.0
        score = 0.2 if len(got) == len(answer) else 0.0
        width = max(len(got), len(answer))
        same = sum(x == y for x, y in zip(got.rjust(width), answer.rjust(width), strict=True))
        return score + 0.3 * same / width


def _parse(prompt: str) -> tuple[int, str, int] | None:
    body = prompt.strip().removesuffix("=")
    for op in "+-*":
        left, sep, right = body.partition(op)
        if sep and left.isdigit() and right.isdigit():
            return int(left), op, int(right)
    return None


def make_task() -> Arithmetic:
    return Arithmetic()
