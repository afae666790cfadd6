"""How a delta's positions are coded, bytes against a region's decode time (chain.codec.api.DIRECT,
the trainer's `direct_positions_pct`): the same Adam-like bf16 versions of a Llama-shaped model
(bench/scale_work.py's, about 1 % of elements changed per version) published with positions as
ranks within their contexts (-1, the default) and directly (each segment decodable in
O(changes)), then decoded by a region as its engine-first path does (`decode_patch` against the
version on disk, a fresh map of it each time, verified), in one process.

    python bench/positions.py [--layers 14] [--direct -1,1000] [--repeat 3] [--json]

Prints per setting the delta's payload bytes and the fastest decode of v1 (over the disk's v0)
and of v2 (over v0 overlaid with v1's patch, as when the disk lags), and each setting's ratios to
the first: `bytes_over_first`, `decode_over_first`. One JSON line last with --json.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.scale_work import adam_like, bf16, calibrate_lr, llama_shapes  # noqa: E402
from chain import keys  # noqa: E402
from chain.decode import decode_patch  # noqa: E402
from chain.policy import SnapshotPolicy  # noqa: E402
from chain.safetensors_io import TensorFiles  # noqa: E402
from chain.store import ChainStore  # noqa: E402
from chain.versiondir import read_info  # noqa: E402
from chain.weights import WeightsDir  # noqa: E402
from trainer.publisher import Publisher  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def versions(hidden: int, layers: int, density: float) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    master = {n: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g).mul_(0.02))
              for n, s in llama_shapes(hidden, layers).items()}
    lr = calibrate_lr(master, density)
    out = [bf16(master)]
    for v in (1, 2):
        adam_like(master, lr, 1000 + v)
        out.append(bf16(master))
    return out


def measure(states: list[dict[str, torch.Tensor]], direct: int, repeat: int, work: Path) -> dict:
    keys.generate(work / "k")
    pub = Publisher(work / "chain", work / "k", "positions", direct_positions=direct,
                    snapshots=SnapshotPolicy(every=10**6, max_delta_ratio=1e9))
    for v, state in enumerate(states):
        pub.publish(v, state)
    del pub
    store = ChainStore(work / "chain")

    def get(b):
        return store.blocks.get(b.id, b.size)

    weights = WeightsDir(work / "w")
    cur = weights.apply(store.plan(None, 0), get)
    digests = read_info(cur.path).tensors
    m1, m2 = store.manifest("v00000001.delta"), store.manifest("v00000002.delta")
    d1, d2 = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        p1 = decode_patch(m1, TensorFiles(cur.path), 0, digests, [], get)
        t1 = time.perf_counter()
        decode_patch(m2, TensorFiles(cur.path), 0, digests, [p1], get)
        d2.append(time.perf_counter() - t1)
        d1.append(t1 - t0)
    return {"direct": direct, "payload_bytes": m1.payload_bytes, "changes": p1.elements,
            "decode_v1_s": min(d1), "decode_v2_over_patch_s": min(d2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=14, help="14: 0.98 B parameters")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--direct", default="-1,1000", help="settings, the first the baseline")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    states = versions(args.hidden, args.layers, args.density)
    params = sum(t.numel() for t in states[0].values())
    log(f"{params / 1e9:.3f} B parameters; load {load0:.1f}")
    rows = []
    for direct in (int(x) for x in args.direct.split(",")):
        with tempfile.TemporaryDirectory(prefix="positions-") as tmp:
            r = measure(states, direct, args.repeat, Path(tmp))
        first = rows[0] if rows else r
        r["bytes_over_first"] = round(r["payload_bytes"] / first["payload_bytes"], 3)
        r["decode_over_first"] = round(r["decode_v1_s"] / first["decode_v1_s"], 3)
        rows.append(r)
        log(f"direct {direct}: {r['payload_bytes'] / 1e6:.2f} MB ({r['bytes_over_first']}x), "
            f"decode {r['decode_v1_s']:.3f} s ({r['decode_over_first']}x), over a patch "
            f"{r['decode_v2_over_patch_s']:.3f} s; {r['changes']:,} changes")
    out = {"params": params, "density": args.density, "rows": rows,
           "load_average_start": load0, "load_average": os.getloadavg()[0]}
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
