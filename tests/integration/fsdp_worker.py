"""One rank of the FSDP2 test trainer (tests/integration/test_sharded_publish.py): the default
model under `fully_shard` in a gloo group on CPU, a deterministic LM step per version, every
version published through ShardedPublisher. Rank 0 also publishes the gathered weights through
a single-process Publisher into a reference chain (a check only: the sharded path gathers
nothing) and writes one JSON line per version. A restarted group replays its steps to the head
and resumes. `--die-before-gather V`: this rank SIGKILLs itself after writing its part of V.

    python -m tests.integration.fsdp_worker --rank R --world 2 --port P --root DIR ...
"""

import argparse
import faulthandler
import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from chain.policy import SnapshotPolicy
from chain.store import ChainStore
from trainer.model import build_default_model, hf_files
from trainer.publisher import Publisher
from trainer.sharded import ShardedPublisher

MODEL = {"hidden": 32, "layers": 2, "heads": 2, "kv_heads": 1}


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("--rank", "--world", "--port", "--steps"):
        ap.add_argument(name, type=int, required=True)
    ap.add_argument("--chain", type=Path, required=True)
    ap.add_argument("--ref-chain", type=Path, required=True)
    ap.add_argument("--key", type=Path, required=True)
    ap.add_argument("--daemon-url")
    ap.add_argument("--token")
    ap.add_argument("--log", type=Path, required=True)
    ap.add_argument("--die-before-gather", type=int)
    a = ap.parse_args()
    faulthandler.enable(all_threads=True)  # a native abort prints every thread's stack
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank,
                            world_size=a.world, timeout=timedelta(seconds=30))
    if a.die_before_gather is not None:
        real = dist.gather_object

        def gather(obj, *args, **kw):
            if getattr(obj, "version", None) == a.die_before_gather:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(obj, *args, **kw)
        dist.gather_object = gather

    model, tok = build_default_model(seed=0, **MODEL)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)

    def step(v: int) -> None:
        g = torch.Generator().manual_seed(v)
        x = torch.randint(0, len(tok), (8, 24), generator=g)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()

    def state() -> dict:
        return {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}

    first = a.rank == 0
    pub = ShardedPublisher(a.chain, "fsdp", key_path=a.key if first else None,
                           daemon_url=a.daemon_url, token=a.token, block_size=1 << 16,
                           snapshots=SnapshotPolicy(every=3))
    ref = Publisher(a.ref_chain, a.key, "fsdp", snapshots=SnapshotPolicy(every=1000)) \
        if first else None
    head = ChainStore(a.chain).head()
    start = 0
    if head is not None:
        for v in range(1, head + 1):
            step(v)
        pub.resume(state())
        full = {k: t.full_tensor() for k, t in state().items()}
        if ref is not None:
            ref.resume(full)
        start = head + 1
    files = hf_files(model, tok) if first else None
    for v in range(start, a.steps + 1):
        if v:
            step(v)
        s = state()
        out = pub.publish(v, s, files=files)
        full = {k: t.full_tensor() for k, t in s.items()}  # the check's reference only
        if ref is not None:
            r = ref.publish(v, full)
            mine = out.delta or out.snapshot
            with open(a.log, "a") as f:
                f.write(json.dumps({
                    "version": v, "digest": mine.state_digest,
                    "ref": (r.delta or r.snapshot).state_digest, "format": mine.format,
                    "streams": mine.streams, "reused": list(out.reused_ranks),
                    "changed": out.changed_elements, "elements": out.elements,
                    "d2h": out.d2h_bytes, "notified": out.notified}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without interpreter shutdown: a gloo worker thread may still drop the last
    # reference to a collective's tensor after its wait() returned; if that lands while Python
    # finalizes, the thread's GIL take ends it with pthread_exit through noexcept C++ frames
    # and the process aborts ("terminate called without an active exception", exit -6) after
    # all its work is done (pytorch/pytorch#117762; about 1 run in 6-10 of a two-rank repro,
    # none of 30 with this exit). The log file is closed by its `with`; only stdio to flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
