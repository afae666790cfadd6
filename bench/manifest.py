"""What a forged manifest costs a node before it is refused: signature first (the current
`Manifest.parse`) against schema validation first (the old order), timed in the same run.

A token holder can hand a node a manifest near the 64 MiB cap; its signature is forged, so all
work spent on it before the refusal is waste on the node's CPU.

    python bench/manifest.py [--tensors 200000]
"""

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chain import keys
from chain.digest import state_digest
from chain.errors import BadManifest
from chain.manifest import Manifest


def forged(n: int, tmp: Path) -> tuple[bytes, object]:
    """A well-formed snapshot manifest of `n` tensors whose signature is garbage."""
    key = keys.generate(tmp / "trainer.key")
    tensors = [{"name": f"model.layers.{i:07d}.mlp.weight", "dtype": "bfloat16",
                "shape": [4096, 4096], "digest": f"{i:032x}"} for i in range(n)]
    blocks = [{"id": f"{i:032x}", "size": 1 << 20, "root": f"{i:064x}"} for i in range(n)]
    doc = {"format": 2, "run": "r", "version": 7, "kind": "snapshot", "parent": None,
           "state_digest": state_digest({t["name"]: t["digest"] for t in tensors}),
           "tensors": tensors, "blocks": blocks, "files": [], "stats": {}, "created": 1.0,
           "signature": {"key": keys.public_hex(key), "sig": "00" * 64}}
    return json.dumps(doc).encode(), key.public_key()


def timed(fn) -> float:
    t0 = time.perf_counter()
    with contextlib.suppress(BadManifest):
        fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=200_000)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        raw, pub = forged(a.tensors, Path(d))

    def validate_first() -> None:  # the old order: full schema validation, then the signature
        m = Manifest.model_validate(json.loads(raw))
        keys.verify(pub, m.canonical(), m.signature.sig)

    old = timed(validate_first)
    new = timed(lambda: Manifest.parse(raw, pub))
    print(f"forged manifest of {len(raw) / 2**20:.1f} MiB ({a.tensors} tensors): "
          f"validate-first {old:.2f} s, signature-first {new:.2f} s, ratio {old / new:.1f}x")


if __name__ == "__main__":
    main()
