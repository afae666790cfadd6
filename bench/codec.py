"""Tensor delta codec benchmark on consecutive bf16 checkpoints of a small RL-trained transformer.

Builds a ~19M-parameter Qwen2, pre-trains it briefly on a synthetic Markov language at lr 1e-3
(cached in ~/.cache/deltaswarm/), then runs GRPO-style policy-gradient steps with fp32 master
weights and AdamW at lr 1e-6, publishing bf16 after each step. Per checkpoint pair it prints the
codec's size against baselines and an entropy estimate, and its speed against one comparison
scan of the whole model, all measured in the same run.

    python bench/codec.py [--fresh] [--lr 1e-6] [--steps 5]
"""

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chain.codec import apply_many, encode_many

VOCAB, ACTIVE, SUCC = 8192, 1024, 4
CACHE = Path(os.path.expanduser("~/.cache/deltaswarm"))


def build_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=384, intermediate_size=1024,
                      num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg)


class MarkovLanguage:
    """Tokens below ACTIVE each have four successors with fixed odds: quick to learn a little
    of, and checkable as a reward."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.succ = torch.randint(0, ACTIVE, (VOCAB, SUCC), generator=g)
        self.odds = torch.tensor([0.5, 0.25, 0.15, 0.1])
        self.g = g
        self.allowed = torch.zeros(VOCAB, VOCAB, dtype=torch.bool)
        self.allowed[torch.arange(VOCAB)[:, None], self.succ] = True

    def sample(self, batch: int, length: int) -> torch.Tensor:
        out = torch.empty(batch, length, dtype=torch.long)
        out[:, 0] = torch.randint(0, ACTIVE, (batch,), generator=self.g)
        for t in range(1, length):
            pick = torch.multinomial(self.odds, batch, replacement=True, generator=self.g)
            out[:, t] = self.succ[out[:, t - 1], pick]
        return out

    def reward(self, seqs: torch.Tensor, start: int) -> torch.Tensor:
        """Allowed transitions in the completion, plus a dense term so groups differ."""
        done = seqs[:, start - 1:]
        ok = self.allowed[done[:, :-1], done[:, 1:]].float().mean(dim=1)
        return ok + 0.5 * (done[:, 1:] % 2 == 0).float().mean(dim=1)


def pretrained(lang: MarkovLanguage, steps: int, fresh: bool) -> dict[str, torch.Tensor]:
    path = CACHE / f"bench-codec-qwen2-19m-a{ACTIVE}-{steps}.pt"
    if path.exists() and not fresh:
        print(f"pre-trained weights: {path} (cached; --fresh to redo)")
        return torch.load(path)
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    t0 = time.perf_counter()
    for step in range(steps):
        x = lang.sample(4, 24)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == steps - 1:
            print(f"  pre-train step {step:3d}  loss {loss.item():.3f}  "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(state, path)
    return state


def rl_checkpoints(lang: MarkovLanguage, state, lr: float, warmup: int, keep: int):
    """GRPO-style steps (groups of samples, group-normalised rewards); bf16 after each."""
    model = build_model()
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
    ckpts = []
    t0 = time.perf_counter()
    for step in range(warmup + keep):
        prompts = lang.sample(2, 6).repeat_interleave(4, dim=0)
        with torch.no_grad():
            seqs = model.generate(prompts, attention_mask=torch.ones_like(prompts),
                                  max_new_tokens=12, do_sample=True, top_k=0, pad_token_id=0)
        reward = lang.reward(seqs, prompts.shape[1]).view(2, 4)
        adv = ((reward - reward.mean(1, keepdim=True)) /
               (reward.std(1, keepdim=True) + 1e-4)).view(-1)
        logits = model(input_ids=seqs).logits[:, prompts.shape[1] - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(
            -1, seqs[:, prompts.shape[1]:, None]).squeeze(-1)
        loss = -(adv[:, None] * logp).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= warmup:
            ckpts.append({k: v.detach().to(torch.bfloat16).view(torch.int16).numpy()
                          .view(np.uint16).reshape(-1).copy()
                          for k, v in model.state_dict().items()})
        print(f"  RL step {step}  reward {reward.mean().item():.3f}  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return ckpts


# ---------------------------------------------------------------- baselines and estimates


def pulse_bytes(old, new, shapes) -> int:
    """PULSE-style COO: row deltas uint8 (255 escapes to uint32), column deltas uint16, new
    values verbatim, zstd level 1 over the whole model's streams."""
    rows, cols, vals = [], [], []
    for name in old:
        idx = np.flatnonzero(old[name] != new[name])
        shape = shapes[name]
        width = shape[-1] if len(shape) >= 2 else 1 << 30
        r, c = np.divmod(idx, width)
        dr = np.diff(r, prepend=0)
        esc = dr >= 255
        rb = np.where(esc, 255, dr).astype(np.uint8)
        rows.append(rb.tobytes())
        rows.append(dr[esc].astype(np.uint32).tobytes())
        newrow = np.concatenate([[True], dr[1:] > 0]) if idx.size else np.zeros(0, bool)
        dc = np.where(newrow, c, np.diff(c, prepend=0))
        cols.append(np.minimum(dc, 0xFFFF).astype(np.uint16).tobytes())
        cols.append(dc[dc >= 0xFFFF].astype(np.uint32).tobytes())
        vals.append(new[name][idx].tobytes())
    blob = b"".join(rows) + b"".join(cols) + b"".join(vals)
    return len(zstandard.ZstdCompressor(level=1).compress(blob))


def xor_zstd_bytes(old, new) -> int:
    blob = b"".join((old[k] ^ new[k]).tobytes() for k in old)
    return len(zstandard.ZstdCompressor(level=1).compress(blob))


def _h(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-300, 1.0)
    q = np.clip(1.0 - p, 1e-300, 1.0)
    return -(p * np.log2(p) + q * np.log2(q))


def entropy_estimate(old, new) -> tuple[float, float]:
    """(position bits, value bits): positions as independent events in (tensor, old exponent)
    buckets, sum of n*H(k/n); values as the empirical entropy of new-old bit differences."""
    pos_bits = 0.0
    diffs = []
    for name in old:
        a, b = old[name], new[name]
        exp = (a >> 7) & 0xFF
        n = np.bincount(exp, minlength=256)
        ch = a != b
        k = np.bincount(exp[ch], minlength=256)
        m = n > 0
        pos_bits += float((n[m] * _h(k[m] / n[m])).sum())
        diffs.append(b[ch].astype(np.int32) - a[ch].astype(np.int32))
    d = np.concatenate(diffs)
    _, counts = np.unique(d, return_counts=True)
    p = counts / counts.sum()
    return pos_bits, float(-(counts * np.log2(p)).sum())


# ---------------------------------------------------------------- timing


def fastest(candidates: dict, rounds: int) -> dict[str, float]:
    """Best time of each candidate (name -> (fn, setup)) over `rounds` interleaved rounds: every
    round runs every candidate once, so a slow spell of this shared machine hits all of them
    alike instead of skewing one ratio."""
    best = dict.fromkeys(candidates, math.inf)
    for _ in range(rounds):
        for name, (fn, setup) in candidates.items():
            arg = setup() if setup else None
            t = time.perf_counter()
            fn(arg)
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def measure_pair(old, new, shapes, repeats: int, threads: int = 2) -> dict:
    names = list(old)
    numel = sum(old[k].size for k in names)
    items = [(old[k], new[k], "bfloat16") for k in names]
    payloads = encode_many(items, threads=threads)
    targets = [old[k].copy() for k in names]
    apply_many([(t, p, "bfloat16") for t, p in zip(targets, payloads, strict=True)],
               threads=threads)
    exact = all(np.array_equal(t, new[k]) for t, k in zip(targets, names, strict=True))
    changed = sum(int(np.count_nonzero(old[k] != new[k])) for k in names)
    ds_bytes = sum(len(p) for p in payloads)
    pos_bits, val_bits = entropy_estimate(old, new)

    def scan(_):
        for k in names:
            np.flatnonzero(old[k] != new[k])

    def copies():
        return [old[k].copy() for k in names]

    def decoder(n):
        def decode(tg):
            apply_many([(t, p, "bfloat16") for t, p in zip(tg, payloads, strict=True)],
                       threads=n)
        return decode

    t = fastest({
        "scan": (scan, None),
        "enc": (lambda _: encode_many(items, threads=threads), None),
        "dec": (decoder(threads), copies),
        "enc1": (lambda _: encode_many(items, threads=1), None),
        "dec1": (decoder(1), copies),
    }, repeats)
    return {
        "numel": numel, "changed": changed, "exact": exact,
        "ds": 8 * ds_bytes, "pulse": 8 * pulse_bytes(old, new, shapes),
        "coo6": 48 * changed, "xor": 8 * xor_zstd_bytes(old, new),
        "est_pos": pos_bits, "est_val": val_bits, **t,
    }


def report(rows: list[dict]) -> None:
    print("\nsize: bits per changed element (x = ratio to dense bf16, 16 bits x numel)")
    head = (f"{'pair':>5} {'density':>8} {'deltaswarm':>16} {'PULSE-style':>16} "
            f"{'int32+bf16':>16} {'XOR+zstd1':>16} {'estimate':>9} {'ds/est':>7} {'exact':>6}")
    print(head)
    for i, r in enumerate(rows):
        k, dense = r["changed"], 16 * r["numel"]

        def cell(bits, k=k, dense=dense):
            return f"{bits / k:6.2f} ({dense / bits:6.1f}x)"

        if k == 0:
            print(f"{i}->{i + 1:<2} nothing changed")
            continue
        est = (r["est_pos"] + r["est_val"]) / k
        print(f"{i}->{i + 1:<2} {k / r['numel']:8.3%} {cell(r['ds']):>16} {cell(r['pulse']):>16} "
              f"{cell(r['coo6']):>16} {cell(r['xor']):>16} {est:9.2f} "
              f"{r['ds'] / k / est:7.3f} {r['exact']!s:>6}")
    print("  estimate = positions as (tensor, old exponent) buckets, sum n*H(k/n), "
          "+ empirical entropy of new-old bit differences; split per pair (pos + val bits):")
    print("  " + ", ".join(f"{r['est_pos'] / r['changed']:.2f} + {r['est_val'] / r['changed']:.2f}"
                           for r in rows))
    print("\nspeed: ratio to one full comparison scan (np.flatnonzero(a != b) over every tensor); "
          "best of interleaved rounds")
    print(f"{'pair':>5} {'scan ms':>8} {'enc ms':>8} {'dec ms':>8} {'enc/scan':>9} "
          f"{'dec/scan':>9} {'enc/scan 1thr':>14} {'dec/scan 1thr':>14}")
    for i, r in enumerate(rows):
        print(f"{i}->{i + 1:<2} {1e3 * r['scan']:8.1f} {1e3 * r['enc']:8.1f} {1e3 * r['dec']:8.1f} "
              f"{r['enc'] / r['scan']:9.2f} {r['dec'] / r['scan']:9.2f} "
              f"{r['enc1'] / r['scan']:14.2f} {r['dec1'] / r['scan']:14.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fresh", action="store_true", help="redo the cached pre-training")
    ap.add_argument("--pretrain-steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--steps", type=int, default=5, help="bf16 checkpoints kept")
    ap.add_argument("--repeats", type=int, default=9,
                    help="interleaved timing rounds; each time is the best of them")
    args = ap.parse_args()
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    lang = MarkovLanguage()
    state = pretrained(lang, args.pretrain_steps, args.fresh)
    ckpts = rl_checkpoints(lang, state, args.lr, warmup=2, keep=args.steps)
    shapes = {k: list(v.shape) for k, v in state.items()}
    numel = sum(v.numel() for v in state.values())
    print(f"model: Qwen2, {numel / 1e6:.1f}M parameters in {len(shapes)} tensors; "
          f"RL lr {args.lr:g}; data ready in {time.perf_counter() - t0:.0f} s")
    torch.set_num_threads(1)  # torch's idle worker threads must not compete with the codec's
    time.sleep(1.0)
    rows = [measure_pair(ckpts[i], ckpts[i + 1], shapes, args.repeats)
            for i in range(len(ckpts) - 1)]
    report(rows)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if not all(r["exact"] for r in rows):
        raise SystemExit("round trip was not bit-exact")


if __name__ == "__main__":
    main()
