"""The inference-engine seam of the rollout worker: a `Completion` record, the `Engine`
protocol every engine implements, and `make_engine(type, ...)` choosing one by name.

An engine always knows which policy version its weights are, and tags each completion with it,
so trajectories carry the version end to end.
"""

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class Completion:
    prompt: str
    prompt_ids: list[int]
    text: str
    token_ids: list[int]
    logprobs: list[float]
    version: int
    finish_reason: str = "length"
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    @property
    def version(self) -> int | None: ...

    def load_version(self, path: str, version: int) -> None:
        """Switch to the weights in HF directory `path` (policy `version`) between batches."""
        ...

    def generate(self, prompts: list[str], n: int, max_tokens: int, temperature: float,
                 seed: int) -> list[Completion]:
        """`n` samples per prompt, prompt-major (prompt 0's samples first). Each completion
        records the log-probability of every sampled token under the sampling distribution
        (logits / temperature; temperature 0 is greedy and records temperature-1 log-probs)."""
        ...


ENGINES = {
    "torch": "rollout.engine_torch:TorchEngine",
    "vllm": "rollout.vllm_server:VllmServerEngine",
}


def make_engine(kind: str, **kwargs: Any) -> Engine:
    if kind not in ENGINES:
        raise ValueError(f"unknown engine type {kind!r}; choose one of {sorted(ENGINES)}")
    module, _, cls = ENGINES[kind].partition(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)
