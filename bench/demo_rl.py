"""The demo's RL without the swarm: warm-up, then GRPO versions trained on rollouts of the
bf16 policy one version old (as the demo's paced workers deliver them), scored on the task's
held-out problems like demo/heldout.py. For tuning the demo in minutes instead of a demo run
each, and for the controls behind its settings (docs/MEASURED.md, "Demo").

    python bench/demo_rl.py [--task rollout.tasks.arithmetic_digits] [--warmup 250]
        [--batch 768] [--group 8] [--temperature 0.5] [--lr 6e-4] [--eps 3e-2]
        [--shuffle-rewards] [--steps 90] [--every 15] [--seed 0]

--shuffle-rewards permutes the rewards within each batch before the step: the same update
sizes with no signal, to see what the gradient noise alone does to the held-out scores. A task
without a held-out split is scored on a fixed draw of its training prompts. One JSON line per
scored version: greedy reward and exact-answer fraction, sampled reward and exact fraction,
the batch reward and the fraction of bf16 elements the step changed.
"""

import argparse
import copy
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from demo.heldout import NoHeldOutSplit, heldout_set
from rollout.engine_torch import TorchEngine
from rollout.tasks import load_task
from trainer.grpo import GRPOConfig, GRPOTrainer
from trainer.model import build_default_model
from trainer.warmup import warmup


def bf16_engine(model: torch.nn.Module, tokenizer, version: int) -> TorchEngine:
    """A TorchEngine on a copy of `model` rounded to bf16, as a region would load it."""
    engine = TorchEngine()
    copied = copy.deepcopy(model).eval()
    with torch.no_grad():
        for p in copied.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    engine.model, engine.tokenizer, engine._version = copied, tokenizer, version
    return engine


def score(engine: TorchEngine, task, prompts: list[str], temperature: float) -> dict:
    greedy = engine.generate(prompts, 1, 6, 0.0, 1234)
    sampled = engine.generate(prompts, 4, 6, temperature, 1234)
    g = [task.reward(c.prompt, c.text) for c in greedy]
    s = [task.reward(c.prompt, c.text) for c in sampled]
    return {"greedy": round(sum(g) / len(g), 4),
            "solved": round(sum(r >= 1 for r in g) / len(g), 4),
            "sampled": round(sum(s) / len(s), 4),
            "sampled_solved": round(sum(r >= 1 for r in s) / len(s), 4)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="rollout.tasks.arithmetic_digits")
    p.add_argument("--warmup", type=int, default=250)
    p.add_argument("--batch", type=int, default=768)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--eps", type=float, default=3e-2)
    p.add_argument("--shuffle-rewards", action="store_true")
    p.add_argument("--steps", type=int, default=90)
    p.add_argument("--every", type=int, default=15)
    p.add_argument("--prompts", type=int, default=400, help="held-out problems scored")
    p.add_argument("--seed", type=int, default=0, help="seed of the rollouts' prompts and samples")
    a = p.parse_args()
    torch.set_num_threads(1)
    task = load_task(a.task)
    try:
        prompts = heldout_set(task, a.prompts, 1234)
    except NoHeldOutSplit:
        prompts = task.sample_prompts(random.Random(1234), a.prompts)
    model, tokenizer = build_default_model(0)
    t0 = time.monotonic()
    warmup(model, tokenizer, task, steps=a.warmup, lr=3e-3, batch=64, seed=0)
    trainer = GRPOTrainer(model, GRPOConfig(lr=a.lr, adam_eps=a.eps, temperature=a.temperature),
                          pad_id=tokenizer.pad_token_id)
    engines = [bf16_engine(trainer.model, tokenizer, 0)]
    rng = random.Random(1000 + a.seed)
    print(json.dumps({"version": 0, **score(engines[-1], task, prompts, a.temperature)}),
          flush=True)
    for version in range(1, a.steps + 1):
        behind = engines[0]  # one version old, as paced workers deliver
        completions = behind.generate(task.sample_prompts(rng, a.batch // a.group), a.group, 6,
                                      a.temperature, rng.getrandbits(63))
        rewards = [task.reward(c.prompt, c.text) for c in completions]
        if a.shuffle_rewards:
            rng.shuffle(rewards)
        m = trainer.step([{"id": str(i), "version": c.version, "group": str(i // a.group),
                           "prompt_ids": c.prompt_ids, "completion_ids": c.token_ids,
                           "logprobs": c.logprobs, "reward": r}
                          for i, (c, r) in enumerate(zip(completions, rewards, strict=True))])
        engines = [engines[-1], bf16_engine(trainer.model, tokenizer, version)]
        if version % a.every == 0 or version == a.steps:
            print(json.dumps({"version": version,
                              **score(engines[-1], task, prompts, a.temperature),
                              "batch_reward": round(m["reward_mean"], 4),
                              "changed": round(m["bf16_changed_frac"], 4),
                              "s": round(time.monotonic() - t0)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
