"""Supervised warm-up on the task's reference answers, so RL starts from a policy with a
non-zero but improvable reward (a random init scores ~0 and GRPO would get no signal).

Deterministic for a seed. The task is resolved from its plug-in spec through importlib (the
trainer never imports rollout/ directly); see `rollout.tasks` for the spec forms.
"""

import importlib
import random
from typing import Any

import torch

from trainer.grpo import token_logprobs

DEFAULT_LOADER = "rollout.tasks:load_task"


def resolve_task(spec: str, loader: str = DEFAULT_LOADER) -> Any:
    """Load a task plug-in through the loader function named by `loader` ("module:function")."""
    module, _, func = loader.partition(":")
    return getattr(importlib.import_module(module), func)(spec)


def _encode(tokenizer: Any, prompts: list[str], refs: list[str]
            ) -> tuple[list[list[int]], list[list[int]]]:
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    completion_ids = [tokenizer(r, add_special_tokens=False)["input_ids"]
                      + [tokenizer.eos_token_id] for r in refs]
    return prompt_ids, completion_ids


def warmup(model: torch.nn.Module, tokenizer: Any, task: Any, *, steps: int = 200,
           lr: float = 3e-3, batch: int = 64, seed: int = 0) -> dict[str, float]:
    """`steps` AdamW steps of next-token loss on prompt -> reference + eos (completion tokens
    only), learning rate decayed linearly to zero. Returns the last loss."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / max(steps, 1))
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        prompts, refs = [], []
        while len(prompts) < batch:
            for p in task.sample_prompts(rng, batch - len(prompts)):
                ref = task.reference(p)
                if ref is not None:
                    prompts.append(p)
                    refs.append(ref)
            if not prompts:
                raise ValueError(f"task {task.name!r} gives no references: cannot warm up on it")
        prompt_ids, completion_ids = _encode(tokenizer, prompts, refs)
        logp, _, mask = token_logprobs(model, prompt_ids, completion_ids, tokenizer.pad_token_id)
        loss = -logp.sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return {"loss": loss.item(), "steps": steps}


@torch.no_grad()
def sample(model: torch.nn.Module, tokenizer: Any, prompts: list[str], max_tokens: int,
           temperature: float, generator: torch.Generator) -> list[str]:
    """Plain (uncached) sampling for evaluation; temperature 0 is greedy."""
    outs = []
    for p in prompts:
        ids = tokenizer(p)["input_ids"]
        new: list[int] = []
        for _ in range(max_tokens):
            logits = model(input_ids=torch.tensor([ids + new]), use_cache=False).logits[0, -1]
            if temperature == 0:
                nxt = int(logits.argmax())
            else:
                probs = torch.softmax(logits.float() / temperature, -1)
                nxt = int(torch.multinomial(probs, 1, generator=generator))
            if nxt == tokenizer.eos_token_id:
                break
            new.append(nxt)
        outs.append(tokenizer.decode(new, skip_special_tokens=True))
    return outs


def evaluate(model: torch.nn.Module, tokenizer: Any, task: Any, *, n: int = 200,
             seed: int = 1, max_tokens: int = 6, temperature: float = 1.0) -> dict[str, float]:
    """Mean reward and exact-answer fraction over `n` fresh prompts."""
    was_training = model.training
    model.eval()
    prompts = task.sample_prompts(random.Random(seed), n)
    gen = torch.Generator().manual_seed(seed)
    texts = sample(model, tokenizer, prompts, max_tokens, temperature, gen)
    rewards = [task.reward(p, c) for p, c in zip(prompts, texts, strict=True)]
    model.train(was_training)
    return {"reward_mean": sum(rewards) / n, "solved_frac": sum(r >= 1.0 for r in rewards) / n}
