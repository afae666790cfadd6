"""A fresh region's first apply with and without the start-up warm-up (issue 11, finding 7).

Each case runs in its own process with its own numba cache directory (`NUMBA_CACHE_DIR`), and
times the first delta applied there, on a chain built beforehand by another process:

- cold:    empty cache, no warm-up: the apply compiles every kernel it meets;
- warm-up: empty cache, `chain.warmup.warm()` in a background thread from process start, as
           the daemon does; the delta "arrives" once the warm-up says ready;
- cached:  the cache the warm-up case filled (a restarted daemon).

    python bench/warmup.py [--numel 4000000]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, sys, threading, time
t_start = time.perf_counter()
from pathlib import Path
from chain.store import ChainStore
from chain.weights import WeightsDir
root, mode = Path(sys.argv[1]), sys.argv[2]
warm_s = None
if mode == "warmup":
    from chain.warmup import warm
    done = threading.Event()
    out = {}
    def run():
        out.update(warm(root))
        done.set()
    threading.Thread(target=run, daemon=True).start()
    done.wait()
    warm_s = out["seconds"]
store = ChainStore(root / "chain")
weights = WeightsDir(root / f"weights-{mode}")
get = lambda b: store.blocks.get(b.id, b.size)
t0 = time.perf_counter()
weights.apply([store.manifest("v00000000.snapshot")], get)
t1 = time.perf_counter()
weights.apply([store.manifest("v00000001.delta")], get)
t2 = time.perf_counter()
print(json.dumps({"mode": mode, "snapshot_apply_s": round(t1 - t0, 3),
                  "first_delta_apply_s": round(t2 - t1, 3), "warmup_s": warm_s}))
"""


def build_chain(root: Path, numel: int) -> None:
    """v0 snapshot + v1 delta (1 % changed) of four bf16 tensors, in a throwaway cache."""
    code = f"""
import numpy as np
from pathlib import Path
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from chain.sources import ArraySource
from chain.store import ChainStore
from chain.writer import write_artifact
root = Path({str(root)!r}); key = Ed25519PrivateKey.generate()
store = ChainStore(root / "chain", key.public_key())
rng = np.random.default_rng(0)
cur = {{f"l.{{i}}": ("bfloat16", [{numel}], rng.integers(0, 1 << 14, {numel}).astype(np.uint16))
       for i in range(4)}}
m0, _ = write_artifact(store.blocks, key, run="b", version=0, kind="snapshot", new=ArraySource(cur))
store.add(m0)
new = {{}}
for k, (d, s, b) in cur.items():
    b = b.copy(); b[rng.integers(0, {numel}, {numel} // 100)] += 1; new[k] = (d, s, b)
m1, _ = write_artifact(store.blocks, key, run="b", version=1, kind="delta", new=ArraySource(new),
                       parent=ArraySource(cur), parent_manifest=m0)
store.add(m1)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_CACHE_DIR": str(root / "numba-build")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def case(root: Path, mode: str, cache: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_CACHE_DIR": str(cache)}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, str(root), mode], check=True, env=env,
                         capture_output=True, text=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["process_s"] = round(time.perf_counter() - t0, 3)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=4_000_000, help="elements per tensor (4 tensors)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="warmup-bench-") as tmp:
        root = Path(tmp)
        build_chain(root, a.numel)
        rows = [case(root, "cold", root / "numba-cold"),
                case(root, "warmup", root / "numba-warm"),
                case(root, "cached", root / "numba-warm")]
    for r in rows:
        print(json.dumps(r))
    cold, warm, cached = (r["first_delta_apply_s"] for r in rows)
    print(f"first delta apply: cold {cold:.2f}s, after warm-up {warm:.2f}s "
          f"({cold / max(warm, 1e-3):.0f}x faster), cached {cached:.2f}s")


if __name__ == "__main__":
    main()
