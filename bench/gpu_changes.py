"""Change detection on the device (trainer/changes.py) measured where the weights live: elements
per second against the device's own copy bandwidth, and bytes copied device -> host against the
delta; then a one-rank ShardedPublisher publishing device tensors, rebuilt and compared with the
single-process Publisher's state digests (the device path's correctness on real hardware).

    python bench/gpu_changes.py [--device cuda] [--elements 2.5e8] [--density 0.01] [--json F]
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainer.changes import bits_of, find_changes  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def best(fn, device: str, rounds: int = 5) -> float:
    times = []
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def detection(device: str, n: int, density: float) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    old = torch.randn(n, device=device, generator=g).mul_(0.02).bfloat16()
    new = old.clone()
    idx = torch.randperm(n, device=device, generator=g)[: int(n * density)]
    new.view(torch.int16)[idx] += 1
    a, b = bits_of(old), bits_of(new)
    dst = torch.empty_like(a)
    copy_s = best(lambda: dst.copy_(a), device)
    bandwidth = 2 * a.nbytes / copy_s  # read + write
    found = find_changes(a, b)
    find_s = best(lambda: find_changes(a, b), device)
    k = int(found.pos.size)
    sparse = k * (4 + 2)
    return {"device": device, "elements": n, "changed": k, "find_s": find_s,
            "elements_per_s": n / find_s, "read_bytes_per_s": 2 * a.nbytes / find_s,
            "copy_bandwidth": bandwidth, "of_bandwidth": (2 * a.nbytes / find_s) / bandwidth,
            "d2h_bytes": found.d2h_bytes, "model_bytes": a.nbytes,
            "d2h_over_sparse_delta": found.d2h_bytes / max(1, sparse),
            "d2h_over_model": found.d2h_bytes / a.nbytes}


def publish_check(device: str) -> dict:
    """A one-rank gloo group publishing device tensors; digests against the CPU Publisher."""
    import torch.distributed as dist

    from chain import keys
    from chain.store import ChainStore
    from chain.weights import WeightsDir
    from tests.integration.harness import free_port
    from trainer.publisher import Publisher
    from trainer.sharded import ShardedPublisher

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}",
                            rank=0, world_size=1)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        keys.generate(tmp / "k")
        pub = ShardedPublisher(tmp / "chain", "gpu", key_path=tmp / "k")
        ref = Publisher(tmp / "ref", tmp / "k", run="gpu")
        g = torch.Generator(device=device).manual_seed(1)
        state = {f"w{i}": torch.randn(1000 + i, 257, device=device, generator=g).bfloat16()
                 for i in range(3)}
        wd = WeightsDir(tmp / "w")
        for v in range(4):
            out = pub.publish(v, state)
            want = ref.publish(v, {k: t.cpu() for k, t in state.items()})
            m = out.delta or out.snapshot
            store = ChainStore(tmp / "chain")
            cur = wd.apply([m], lambda b, s=store: s.blocks.get(b.id, b.size))
            ok &= m.state_digest == (want.delta or want.snapshot).state_digest \
                == cur.state_digest
            for t in state.values():
                t.view(torch.int16).view(-1)[:: 97 + v] += 1
    dist.destroy_process_group()
    return {"publish_digests_match": bool(ok)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--elements", type=float, default=2.5e8)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_changes: no CUDA device visible to torch")
    out = detection(a.device, int(a.elements), a.density)
    out |= publish_check(a.device)
    print(f"change detection on {a.device}: {out['elements']:.3g} bf16 elements, "
          f"{out['changed']} changed, {out['find_s'] * 1e3:.1f} ms = "
          f"{out['elements_per_s'] / 1e9:.2f} G elements/s, reading at "
          f"{out['of_bandwidth']:.2f}x the device's copy bandwidth "
          f"({out['copy_bandwidth'] / 1e9:.0f} GB/s); device->host "
          f"{out['d2h_bytes'] / 1e6:.2f} MB = {out['d2h_over_sparse_delta']:.2f}x the sparse "
          f"delta (int32 position + bf16 value), {out['d2h_over_model'] * 100:.2f} % of the "
          f"tensor; sharded publish of device tensors matches the CPU Publisher: "
          f"{out['publish_digests_match']}")
    if a.json:
        a.json.write_text(json.dumps(out))
    if not out["publish_digests_match"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
