"""chain.warmup: after `warm()`, a real apply of another shape meets no kernel signature it
has not seen, so a fresh region's first apply compiles nothing (issue 11, finding 7). Runs in a
fresh interpreter: kernels this pytest process already compiled would hide a gap. With the
kernels compiled at install (chain/codec/aot.py) neither the warm-up nor the apply JIT-compiles
anything at all."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

CHILD = r"""
import json, sys
from pathlib import Path
import numpy as np
from numba.core.registry import CPUDispatcher
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
import chain.codec.kernels, chain.codec.rangecoder, chain.lanehash
from chain.sources import ArraySource
from chain.store import ChainStore
from chain.warmup import warm
from chain.weights import WeightsDir
from chain.writer import write_artifact

def seen():
    return {f"{mod.__name__}.{n}": len(d.signatures)
            for mod in (chain.codec.kernels, chain.codec.rangecoder, chain.lanehash)
            for n, d in vars(mod).items() if isinstance(d, CPUDispatcher)}

root = Path(sys.argv[1])
before = seen()
kernels = warm(root)["kernels"]
after_warm = seen()
key = Ed25519PrivateKey.generate()
store = ChainStore(root / "chain", key.public_key())
rng = np.random.default_rng(1)
n = 300_001
cur = {"a": ("bfloat16", [n], rng.integers(0, 1 << 14, n).astype(np.uint16)),
       "b": ("float32", [n], rng.integers(0, 1 << 30, n).astype(np.uint32))}
m0, _ = write_artifact(store.blocks, key, run="t", version=0, kind="snapshot", new=ArraySource(cur))
store.add(m0)
new = {k: (d, s, b.copy()) for k, (d, s, b) in cur.items()}
for _, _, b in new.values():
    b[rng.integers(0, n, n // 50)] += 1
m1, _ = write_artifact(store.blocks, key, run="t", version=1, kind="delta", new=ArraySource(new),
                       parent=ArraySource(cur), parent_manifest=m0)
store.add(m1)
weights = WeightsDir(root / "weights")
get = lambda b: store.blocks.get(b.id, b.size)
weights.apply([m0], get)
warm_only = seen()
weights.apply([m1], get)
print(json.dumps({"before": before, "after_warm": after_warm, "after_apply": seen(),
                  "before_apply": warm_only, "kernels": kernels}))
"""


def test_after_warm_up_an_apply_compiles_no_new_kernel(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if got["kernels"] == "aot":  # compiled at install (chain/codec/aot.py): nothing to JIT
        assert got["after_apply"] == got["before"], "a kernel was JIT-compiled despite AOT"
        return
    assert sum(got["after_warm"].values()) > sum(got["before"].values())
    assert got["after_warm"]["chain.codec.kernels.decode_segment"] >= 1
    new = {k: (got["after_warm"][k], v) for k, v in got["after_apply"].items()
           if v != got["after_warm"][k]}
    assert new == {}, f"kernels compiled after the warm-up: {new}"
