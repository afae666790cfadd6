"""In-place sparse weight apply on a device, against full copies and a safetensors reload.

What a daemon next to a GPU engine would do per version: stage a sparse delta (positions + new
bf16 values) on the device, then write it into the live bf16 weights. Needs only torch,
safetensors and numpy; installs nothing, touches no network. Bit-exactness is checked with
`torch.equal` on the 16-bit integer views. Run: python bench/gpu_apply.py [--device cpu --small]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

try:
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file
except ImportError as exc:  # the GPU box may lack one of these; say which and stop
    sys.exit(f"gpu_apply: missing module {exc.name!r}; this bench needs torch, safetensors, numpy")

MODELS: dict[str, dict[str, int]] = {
    # Llama-like shapes; "1b" is TinyLlama-1.1B's (22 layers, 2048 hidden, 5632 MLP, GQA 4 kv).
    "tiny": dict(layers=2, hidden=64, mlp=176, heads=4, kv_heads=2, vocab=96),
    "mid": dict(layers=4, hidden=512, mlp=1408, heads=8, kv_heads=2, vocab=8000),
    "1b": dict(layers=22, hidden=2048, mlp=5632, heads=32, kv_heads=4, vocab=32000),
}


def shapes(cfg: dict[str, int]) -> dict[str, tuple[int, ...]]:
    h, kv = cfg["hidden"], cfg["hidden"] // cfg["heads"] * cfg["kv_heads"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab"], h)}
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (cfg["mlp"], h),
            p + "mlp.up_proj.weight": (cfg["mlp"], h),
            p + "mlp.down_proj.weight": (h, cfg["mlp"]),
        }
    return out | {"model.norm.weight": (h,), "lm_head.weight": (cfg["vocab"], h)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median seconds of `fn` over `repeats` runs after one warm-up."""
    fn()
    sync(device)
    runs = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


class Case:
    """One model: an arena of live bf16 weights, the old and new states, and a sparse delta."""

    def __init__(self, name: str, device: torch.device, density: float, seed: int) -> None:
        self.name, self.device = name, device
        self.shapes = shapes(MODELS[name])
        numels = {k: math.prod(s) for k, s in self.shapes.items()}
        self.numel = sum(numels.values())
        gen = torch.Generator(device=device).manual_seed(seed)
        old = (torch.randn(self.numel, generator=gen, device=device) * 0.02).to(torch.bfloat16)
        pick = torch.rand(self.numel, generator=gen, device=device) < density
        pos = torch.nonzero(pick).squeeze(1)
        step = torch.where(torch.rand(pos.numel(), generator=gen, device=device) < 0.5, -1, 1)
        new = old.clone()
        bits(new)[pos] = (bits(old)[pos].to(torch.int32) + step).to(torch.int16)
        self.old, self.new = old, new
        self.arena = old.clone()  # the live weights: every tensor is a view into it
        self.offsets: dict[str, int] = {}
        off = 0
        for k, n in numels.items():
            self.offsets[k] = off
            off += n
        # the delta as a daemon has it on the host: per tensor int32 positions + bf16 values
        pos_cpu = pos.to("cpu", torch.int64).numpy()
        vals_cpu = new[pos].cpu()
        self.host_delta: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for k, n in numels.items():
            lo, hi = np.searchsorted(pos_cpu, [self.offsets[k], self.offsets[k] + n])
            p = torch.from_numpy((pos_cpu[lo:hi] - self.offsets[k]).astype(np.int32))
            v = vals_cpu[lo:hi]
            if device.type == "cuda":
                p, v = p.pin_memory(), v.pin_memory()
            self.host_delta[k] = (p, v)
        self.changed = int(pos.numel())
        self.flat_pos_host = pos.to("cpu", torch.int32)
        self.flat_vals_host = vals_cpu
        self.host_new = new.cpu().pin_memory() if device.type == "cuda" else new.cpu()

    def live(self, name: str) -> torch.Tensor:
        n = math.prod(self.shapes[name])
        return self.arena[self.offsets[name] : self.offsets[name] + n]

    def reset(self) -> None:
        self.arena.copy_(self.old)
        sync(self.device)

    def exact(self) -> bool:
        return torch.equal(bits(self.arena), bits(self.new))

    def delta_bytes(self) -> int:
        return sum(p.numel() * 4 + v.numel() * 2 for p, v in self.host_delta.values())


def stage(case: Case) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    d = case.device
    return {k: (p.to(d, non_blocking=True), v.to(d, non_blocking=True))
            for k, (p, v) in case.host_delta.items()}


def run_case(case: Case, repeats: int, tmp: Path) -> list[dict]:
    rows: list[dict] = []
    staged = stage(case)
    sync(case.device)

    def record(method: str, seconds: float, moved: int, check: bool = True) -> None:
        rows.append(dict(model=case.name, method=method, ms=seconds * 1e3, bytes=moved,
                         exact=case.exact() if check else None))
        case.reset()

    def index_copy() -> None:
        for k, (p, v) in staged.items():
            case.live(k).index_copy_(0, p.long(), v)

    def index_put() -> None:
        for k, (p, v) in staged.items():
            case.live(k).index_put_((p.long(),), v)

    def scatter() -> None:
        for k, (p, v) in staged.items():
            case.live(k).scatter_(0, p.long(), v)

    flat_pos = case.flat_pos_host.to(case.device)
    flat_vals = case.flat_vals_host.to(case.device)

    def arena_one_call() -> None:
        case.arena.index_copy_(0, flat_pos.long(), flat_vals)

    def stage_and_apply() -> None:
        for k, (p, v) in stage(case).items():
            case.live(k).index_copy_(0, p.long(), v)

    dbytes = case.delta_bytes()
    record("stage delta H2D (int32 pos + bf16)", timed(lambda: stage(case), case.device,
                                                       repeats), dbytes, check=False)
    for method, fn in [("apply index_copy_ per tensor", index_copy),
                       ("apply index_put_ per tensor", index_put),
                       ("apply scatter_ per tensor", scatter),
                       ("apply index_copy_ one call (arena)", arena_one_call),
                       ("stage + apply index_copy_", stage_and_apply)]:
        case.reset()
        record(method, timed(fn, case.device, repeats), dbytes if "stage" in method else 0)

    full = case.numel * 2
    record("full copy_ from host (pinned)",
           timed(lambda: case.arena.copy_(case.host_new, non_blocking=True), case.device,
                 repeats), full)
    dev_new = case.new.clone()
    record("full copy_ device-to-device",
           timed(lambda: case.arena.copy_(dev_new), case.device, repeats), 0)

    sdir = tmp / case.name
    sdir.mkdir()
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, files = 0, []
    host_new = case.new.cpu()
    for k, s in case.shapes.items():
        n = math.prod(s)
        shard[k] = host_new[case.offsets[k] : case.offsets[k] + n].view(s).clone()
        shard_bytes += n * 2
        if shard_bytes >= 2 << 30:
            files.append(sdir / f"model-{len(files):05d}.safetensors")
            save_file(shard, str(files[-1]))
            shard, shard_bytes = {}, 0
    if shard:
        files.append(sdir / f"model-{len(files):05d}.safetensors")
        save_file(shard, str(files[-1]))
    dev = str(case.device)

    def reload_dir() -> None:
        for f in files:
            for k, t in load_file(str(f), device=dev).items():
                case.live(k).copy_(t.view(-1))

    record("reload safetensors dir (page cache warm)", timed(reload_dir, case.device, repeats),
           full)
    for f in files:
        f.unlink()
    return rows


def print_table(rows: list[dict], cases: dict[str, Case]) -> None:
    print(f"{'model':5} {'method':42} {'ms':>10} {'MB moved':>9} {'vs host copy':>12} exact")
    for r in rows:
        base = next(x["ms"] for x in rows
                    if x["model"] == r["model"] and x["method"].startswith("full copy_ from host"))
        print(f"{r['model']:5} {r['method']:42} {r['ms']:10.3f} {r['bytes'] / 1e6:9.2f} "
              f"{base / r['ms']:11.1f}x { {True: 'yes', False: 'NO', None: '-'}[r['exact']] }")
    for c in cases.values():
        print(f"# {c.name}: {c.numel / 1e6:.1f} M params, {c.changed} changed "
              f"({c.changed / c.numel:.2%}), delta {c.delta_bytes() / 1e6:.2f} MB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny + mid models only (CPU check)")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_apply: CUDA is not available to this torch; use --device cpu --small")
    names = ["tiny", "mid"] if args.small else ["tiny", "1b"]
    print(f"# torch {torch.__version__} device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    rows: list[dict] = []
    cases: dict[str, Case] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_apply-") as tmp:
        for i, name in enumerate(names):
            cases[name] = Case(name, device, args.density, args.seed + i)
            rows += run_case(cases[name], args.repeats, Path(tmp))
    print_table(rows, cases)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["exact"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
