"""Async GRPO on trajectories from rollout workers: fp32 master weights, AdamW, group-relative
advantages and a token-level loss with truncated importance sampling against the behaviour
log-probabilities the rollout recorded (its policy may be a few versions old).

`GRPOTrainer.step(trajectories) -> metrics` is one optimizer step = one new policy version;
`state_dict_bf16()` is what gets published.
"""

import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.staleness import filter_stale


@dataclass(kw_only=True)
class GRPOConfig:
    lr: float = 1e-4
    """Sets both learning speed and delta density (bf16 changes when an update crosses |w|/256):
    on the default tiny model 1e-4 changes ~20 % of elements per step, 3e-5 ~10 %."""
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    adam_eps: float = 1e-4
    """Above torch's 1e-8 on purpose: it damps updates of weights whose gradients are tiny
    (noise), so fewer bf16 values change per step."""
    grad_clip: float = 1.0
    is_cap: float = 2.0
    """Truncated importance sampling: per-token weight min(pi/mu, is_cap)."""
    max_staleness: int = 4
    adv_eps: float = 1e-6
    temperature: float = 1.0
    """Must equal the rollout sampling temperature, so recomputed log-probs match behaviour."""
    micro_batch: int = 256
    track_bf16_density: bool = True


def group_advantages(rewards: list[float], groups: list[str], eps: float = 1e-6) -> torch.Tensor:
    """(reward - group mean) / (group std + eps), std over the group (population). A group of
    one, or one whose rewards are all equal, carries no signal: advantage 0."""
    r = torch.tensor(rewards, dtype=torch.float64)
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    adv = torch.zeros_like(r)
    for idx in members.values():
        sel = r[idx]
        std = sel.std(unbiased=False)
        if std > 0:
            adv[idx] = (sel - sel.mean()) / (std + eps)
    return adv.float()


def tis_loss(logp: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, cap: float, n_tokens: int | None = None
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level policy-gradient loss with truncated importance sampling.

    loss = -sum(min(exp(logp - behaviour), cap) * A * logp * mask) / n_tokens, the weight
    detached, so the gradient is the IS-corrected policy gradient. `advantages` is per sequence.
    """
    mask = mask.to(logp.dtype)
    n = float(mask.sum()) if n_tokens is None else float(n_tokens)
    log_ratio = (logp - behaviour).detach() * mask
    ratio = log_ratio.exp()
    weight = ratio.clamp(max=cap)
    loss = -(weight * advantages[:, None] * logp * mask).sum() / max(n, 1.0)
    valid = mask.bool()
    stats = {
        "is_ratio_mean": float(ratio[valid].mean()) if valid.any() else 1.0,
        "is_clipped_frac": float((ratio[valid] > cap).float().mean()) if valid.any() else 0.0,
        "kl_behaviour": float(((ratio - 1 - log_ratio) * mask).sum() / max(n, 1.0)),
    }
    return loss, stats


def token_logprobs(model: torch.nn.Module, prompt_ids: list[list[int]],
                   completion_ids: list[list[int]], pad_id: int, temperature: float = 1.0,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-prob and entropy of each completion token under `model`, right-padded to [B, T],
    with the mask of real completion tokens."""
    seqs = [p + c for p, c in zip(prompt_ids, completion_ids, strict=True)]
    width = max(len(s) for s in seqs)
    device = next(model.parameters()).device
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs], device=device)
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits.float()
    t_max = max(len(c) for c in completion_ids)
    starts = torch.tensor([len(p) - 1 for p in prompt_ids], device=device)
    pos = (starts[:, None] + torch.arange(t_max, device=device)[None]).clamp(max=width - 2)
    mask = torch.arange(t_max, device=device)[None] < torch.tensor(
        [len(c) for c in completion_ids], device=device)[:, None]
    picked = logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1])) / temperature
    logp_all = torch.log_softmax(picked, -1)
    targets = ids.gather(1, (pos + 1).clamp(max=width - 1))
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp * mask, entropy.detach() * mask, mask


class GRPOTrainer:
    """Holds the fp32 master weights and the optimizer; one `step` per policy version."""

    def __init__(self, model: torch.nn.Module, config: GRPOConfig, version: int = 0,
                 pad_id: int = 0) -> None:
        self.model = model.float().train()
        self.config = config
        self.version = version
        self.pad_id = pad_id
        self.opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas,
                                     eps=config.adam_eps, weight_decay=config.weight_decay)
        self._last_bf16 = self.state_dict_bf16() if config.track_bf16_density else None

    def state_dict_bf16(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to(torch.bfloat16).contiguous().cpu()
                for k, v in self.model.state_dict().items()}

    def step(self, trajectories: list[dict[str, Any]]) -> dict[str, Any]:
        """Filter by staleness, then one AdamW step over the kept trajectories (version += 1).
        With nothing kept, no step is taken and `stepped` is False."""
        t0 = time.perf_counter()
        cfg = self.config
        report = filter_stale(trajectories, self.version, cfg.max_staleness)
        kept = [t for t in report.kept if len(t["completion_ids"]) > 0]
        metrics: dict[str, Any] = {
            "version": self.version, "received": len(trajectories), "kept": len(kept),
            "dropped_stale": report.dropped_stale, "dropped_future": report.dropped_future,
            "staleness_hist": report.histogram, "stepped": False,
        }
        if not kept:
            return metrics
        for t in kept:
            if len(t["logprobs"]) != len(t["completion_ids"]):
                raise ValueError(f"trajectory {t.get('id')}: {len(t['logprobs'])} logprobs for "
                                 f"{len(t['completion_ids'])} completion tokens")
        rewards = [float(t["reward"]) for t in kept]
        adv = group_advantages(rewards, [t["group"] for t in kept], cfg.adv_eps)
        n_tokens = sum(len(t["completion_ids"]) for t in kept)
        self.opt.zero_grad(set_to_none=True)
        agg: dict[str, float] = defaultdict(float)
        for lo in range(0, len(kept), cfg.micro_batch):
            chunk = kept[lo:lo + cfg.micro_batch]
            logp, entropy, mask = token_logprobs(
                self.model, [t["prompt_ids"] for t in chunk],
                [t["completion_ids"] for t in chunk], self.pad_id, cfg.temperature)
            behaviour = torch.zeros_like(logp)
            for i, t in enumerate(chunk):
                behaviour[i, :len(t["logprobs"])] = torch.tensor(t["logprobs"])
            loss, stats = tis_loss(logp, behaviour, adv[lo:lo + len(chunk)].to(logp.device),
                                   mask, cfg.is_cap, n_tokens)
            loss.backward()
            share = float(mask.sum()) / n_tokens
            agg["loss"] += loss.item()
            agg["entropy"] += float(entropy.sum()) / n_tokens
            agg["kl_behaviour"] += stats["kl_behaviour"]
            agg["is_ratio_mean"] += stats["is_ratio_mean"] * share
            agg["is_clipped_frac"] += stats["is_clipped_frac"] * share
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.opt.step()
        self.version += 1
        elapsed = time.perf_counter() - t0
        r = torch.tensor(rewards)
        metrics.update(agg)
        metrics.update({
            "version": self.version, "stepped": True,
            "reward_mean": float(r.mean()), "reward_std": float(r.std(unbiased=False)),
            "solved_frac": float((r >= 1.0).float().mean()),
            "grad_norm": float(grad_norm), "tokens": n_tokens,
            "step_s": elapsed, "tokens_per_s": n_tokens / elapsed,
        })
        if self._last_bf16 is not None:
            new = self.state_dict_bf16()
            metrics["bf16_changed_frac"] = bf16_changed_fraction(self._last_bf16, new)
            self._last_bf16 = new
        return metrics

    def save_checkpoint(self, path: str | Path) -> None:
        """fp32 master weights, optimizer state and version, for a trainer restart."""
        tmp = Path(f"{path}.tmp")
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                    "version": self.version}, tmp)
        tmp.replace(path)

    def load_checkpoint(self, path: str | Path) -> None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.version = int(state["version"])
        if self.config.track_bf16_density:
            self._last_bf16 = self.state_dict_bf16()


def bf16_changed_fraction(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> float:
    """Fraction of elements whose bf16 bit pattern differs: the density of the next delta."""
    changed = total = 0
    for name, a in old.items():
        b = new[name]
        changed += int((a.view(torch.int16) != b.view(torch.int16)).sum())
        total += a.numel()
    return changed / max(total, 1)
