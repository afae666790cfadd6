"""One rank of `bench/scale.py --ranks N`: holds its dim-0 rows of every tensor of the versions
bench/scale_work.py gen wrote (read from the file slice by slice, so it never holds the whole
model) and publishes each through ShardedPublisher in a gloo group. The driver samples this
process's memory between the marks, as for the other roles. Not meant to be run by hand:

    python bench/scale_rank.py WORKDIR RANK WORLD PORT
"""

import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from scale_work import RUN, clear_peak, hwm_bytes, mark  # noqa: E402

from chain import keys  # noqa: E402
from chain.policy import SnapshotPolicy  # noqa: E402
from trainer.rank_encoder import RankEncoder, Slice  # noqa: E402
from trainer.sharded import Shard, ShardedPublisher  # noqa: E402


def rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """FSDP2's dim-0 split: ceil(n / world) rows per rank, the last ones fewer or none."""
    per = -(-n // world)
    return min(n, rank * per), min(n, (rank + 1) * per)


def load_shard(work: Path, v: int, rank: int, world: int) -> dict[str, Shard]:
    from safetensors import safe_open

    out = {}
    with safe_open(str(work / f"v{v}.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            sl = f.get_slice(name)
            shape = tuple(sl.get_shape())
            lo, hi = rows(shape[0], rank, world)
            t = sl[lo:hi].clone()  # anonymous memory, like a trainer's own shard
            out[name] = Shard(t, shape, lo * math.prod(shape[1:]))
    return out


def warm_up(tmp: Path) -> None:
    """Before the base mark: compile (or load) the codec and digest kernels on slices that
    start on and off a word boundary, over several segments so both codec threads make their
    workspaces (as the single-process Publisher's warm-up does; their pages are touched as a
    delta's changes need them, so the measured versions still count what they use)."""
    from chain.blocks import BlockStore
    from trainer.changes import bits_of

    enc = RankEncoder(BlockStore(tmp / "blocks"), tmp / "parts", 0, 1 << 20)
    n = 4 << 20
    w = [torch.randn(n).bfloat16(), torch.randn(4096).bfloat16()]

    def slices() -> list[Slice]:
        return [Slice("a", "bfloat16", [n + 8], 4, bits_of(w[0])),
                Slice("b", "bfloat16", [4099], 3, bits_of(w[1]))]

    enc.encode(0, slices(), parent_digest=None, snapshot=True)
    enc.commit()
    for t in w:
        t.view(torch.int16)[::97] += 1  # about the density measured
    enc.encode(1, slices(), parent_digest="0" * 32, snapshot=False)


def main() -> None:
    work, rank, world, port = Path(sys.argv[1]), *map(int, sys.argv[2:5])
    cfg = json.loads((work / "config.json").read_text())
    mark(mark="boot")
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        warm_up(Path(tmp))
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    root = work / f"ranks{world}"
    key = work / "sharded.key"
    if rank == 0:
        keys.generate(key)
    dist.barrier()
    pub = ShardedPublisher(root / "chain", RUN, key_path=key if rank == 0 else None,
                           snapshots=SnapshotPolicy(every=10**6, max_delta_ratio=1e9))
    mark(mark="base")
    for v in range(cfg["versions"] + 1):
        state = load_shard(work, v, rank, world)
        caller = sum(s.tensor.nbytes for s in state.values())
        # every rank starts its publish together, as a trainer's ranks do after the optimizer
        # step: a rank's time is then the publish's, not the other rank's lag in loading its
        # shard above (0.12 s of a 1.2 s version, docs/MEASURED.md stop 58)
        dist.barrier()
        clear_peak()
        mark(mark="begin", label=f"rank {rank}/{world} publish v{v}")
        t0 = time.perf_counter()
        out = pub.publish(v, state)
        seconds = time.perf_counter() - t0
        m = out.delta or out.snapshot
        mark(mark="end", label=f"rank {rank}/{world} publish v{v}", hwm=hwm_bytes(),
             result={"version": v, "seconds": seconds, "caller_bytes": caller,
                     "encode_s": m.stats["seconds"],  # the slowest rank's own part
                     "changed": out.changed_elements, "elements": out.elements,
                     "d2h": out.d2h_bytes, "artifact_bytes": m.payload_bytes, "kind": m.kind,
                     "streams": m.streams})
        del state
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
