"""The measured halves of bench/scale.py, each run as its own process so its memory and disk
writes can be read from /proc/<pid> alone (the driver samples them between the marks printed
here). Not meant to be run by hand:

    python bench/scale_work.py ROLE WORKDIR     # ROLE: gen baseline publish region e2e huge
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chain import keys  # noqa: E402
from chain.policy import SnapshotPolicy  # noqa: E402
from chain.store import ChainStore  # noqa: E402
from chain.weights import WeightsDir  # noqa: E402
from trainer.publisher import Publisher  # noqa: E402

RUN = "scale"
VOCAB = 32000


def mark(**doc: object) -> None:
    """One line the driver reads; a phase mark waits until the driver has read this process's
    /proc figures (it answers with a line on stdin)."""
    print("@@ " + json.dumps(doc), flush=True)
    if "mark" in doc:
        sys.stdin.readline()


def clear_peak() -> None:
    """Reset the kernel's peak-RSS counter (VmHWM) so the next phase's peak is its own."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def llama_shapes(hidden: int, layers: int) -> dict[str, list[int]]:
    """Tensor names and shapes of an HF Llama with 4x MLP, grouped-query attention (4 query
    heads per KV head) and untied embeddings."""
    kv, inter = hidden // 4, 4 * hidden
    shapes = {"model.embed_tokens.weight": [VOCAB, hidden], "lm_head.weight": [VOCAB, hidden],
              "model.norm.weight": [hidden]}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": [hidden, hidden],
                   p + "self_attn.k_proj.weight": [kv, hidden],
                   p + "self_attn.v_proj.weight": [kv, hidden],
                   p + "self_attn.o_proj.weight": [hidden, hidden],
                   p + "mlp.gate_proj.weight": [inter, hidden],
                   p + "mlp.up_proj.weight": [inter, hidden],
                   p + "mlp.down_proj.weight": [hidden, inter],
                   p + "input_layernorm.weight": [hidden],
                   p + "post_attention_layernorm.weight": [hidden]}
    return shapes


def adam_like(master: dict[str, torch.Tensor], lr: float, seed: int) -> None:
    """One optimizer step on fp32 master weights: every element moves by lr times a bounded
    random direction (|m/sqrt(v)| <= 1 as in Adam), so bf16 changes where rounding flips."""
    g = torch.Generator().manual_seed(seed)
    for name in sorted(master):
        master[name].add_(torch.randn(master[name].shape, generator=g).tanh_(), alpha=-lr)


def bf16(master: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.bfloat16() for k, v in master.items()}


def calibrate_lr(master: dict[str, torch.Tensor], density: float) -> float:
    """The lr giving about `density` changed bf16 elements, fitted on a 4M-element sample
    (density is nearly proportional to lr while it is small)."""
    g = torch.Generator().manual_seed(1)
    mats = [v.view(-1) for v in master.values() if v.dim() == 2]
    total = sum(m.numel() for m in mats)
    sample = torch.cat([m[torch.randint(0, m.numel(), (1 + (m.numel() << 22) // total,),
                                        generator=g)] for m in mats])
    lr = 1e-5
    for _ in range(4):
        moved = sample - lr * torch.randn(sample.shape, generator=g).tanh_()
        got = (moved.bfloat16() != sample.bfloat16()).float().mean().item()
        lr *= density / max(got, 1e-9)
    return lr


def role_gen(work: Path, cfg: dict) -> None:
    """fp32 master weights -> v0..vN bf16 safetensors files (what the trainer would hand over)."""
    import safetensors.torch as st

    g = torch.Generator().manual_seed(cfg["seed"])
    master = {}
    for name, shape in llama_shapes(cfg["hidden"], cfg["layers"]).items():
        master[name] = (torch.ones(shape) if len(shape) == 1
                        else torch.randn(shape, generator=g).mul_(0.02))
    lr = calibrate_lr(master, cfg["density"])
    for v in range(cfg["versions"] + 1):
        if v:
            adam_like(master, lr, seed=1000 + v)
        st.save_file(bf16(master), str(work / f"v{v}.safetensors"))
        print(f"gen: wrote v{v}", flush=True)
    mark(result={"lr": lr})


def load(work: Path, v: int) -> dict[str, torch.Tensor]:
    """Version v in anonymous memory, like a trainer's own tensors (safetensors alone would
    leave them mmap'd from the page cache)."""
    import safetensors.torch as st

    return {k: t.clone() for k, t in st.load_file(str(work / f"v{v}.safetensors")).items()}


def role_baseline(work: Path, cfg: dict) -> None:
    """One comparison scan (`a != b` per tensor, fastest of the runs), one sequential read and
    one save_file of the whole model, plus the
    measured density of every version step."""
    import safetensors.torch as st

    prev, changed, scans = load(work, 0), [], []
    elements = sum(t.numel() for t in prev.values())
    for v in range(1, cfg["versions"] + 1):
        cur = load(work, v)
        for _ in range(3 if v == 1 else 1):
            t0 = time.perf_counter()
            for k in cur:
                cur[k] != prev[k]  # noqa: B015 (the comparison is what is timed)
            scans.append(time.perf_counter() - t0)
        changed.append(sum(int((cur[k].view(torch.int16) != prev[k].view(torch.int16)).sum())
                           for k in cur))
        prev = cur
    path = work / f"v{cfg['versions']}.safetensors"
    buf = np.empty(path.stat().st_size, np.uint8)
    reads = []
    for _ in range(2):  # the second from a warm page cache, like a region's fresh blocks
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            view, off = memoryview(buf), 0
            while off < len(buf):
                off += f.readinto(view[off:off + (64 << 20)])
        reads.append(time.perf_counter() - t0)
    read_s = min(reads)
    del buf
    out = work / "save_baseline.safetensors"
    t0 = time.perf_counter()
    st.save_file(prev, str(out))
    save_s = time.perf_counter() - t0
    out.unlink()
    mark(result={"scan_s": min(scans), "read_s": read_s, "save_s": save_s,
                 "elements": elements, "changed": changed})


def _warm_up_publisher(tmp: Path) -> None:
    """Compile the codec (numba) on a tiny model, so the measured phases hold no JIT memory."""
    key = tmp / "warm.key"
    keys.generate(key)
    pub = Publisher(chain_dir=tmp / "chain", key_path=key, run="warm")
    state = {"w": torch.randn(512, 512).bfloat16()}
    pub.publish(0, state)
    state["w"].view(torch.int16)[::7] += 1
    pub.publish(1, state)
    weights = WeightsDir(tmp / "weights")
    store = pub.store
    weights.apply([store.get(0, "snapshot"), store.get(1, "delta")],
                  lambda b: store.blocks.get(b.id, b.size))


def role_publish(work: Path, cfg: dict) -> None:
    """Publisher.publish of v0 (snapshot) then each delta, one version's tensors held at a time
    by the caller."""
    mark(mark="boot")
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        _warm_up_publisher(Path(tmp))
    keys.generate(work / "trainer.key")
    pub = Publisher(chain_dir=work / "pub" / "chain", key_path=work / "trainer.key", run=RUN,
                    snapshots=SnapshotPolicy(every=10**6, max_delta_ratio=1e9))
    mark(mark="base")
    for v in range(cfg["versions"] + 1):
        state = load(work, v)
        caller = sum(t.nbytes for t in state.values())
        clear_peak()
        mark(mark="begin", label=f"publish v{v}")
        t0 = time.perf_counter()
        out = pub.publish(v, state)
        seconds = time.perf_counter() - t0
        m = out.delta or out.snapshot
        mark(mark="end", label=f"publish v{v}", hwm=hwm_bytes(),
             result={"version": v, "seconds": seconds, "caller_bytes": caller,
                     "changed": out.changed_elements, "elements": out.elements,
                     "artifact_bytes": sum(b.size for b in m.blocks), "kind": m.kind})
        del state


def role_region(work: Path, cfg: dict) -> None:
    """WeightsDir.apply of v0 then each delta, blocks read from the publisher's block store."""
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        _warm_up_publisher(Path(tmp))
    store = ChainStore(work / "pub" / "chain")
    weights = WeightsDir(work / "region" / "weights")
    mark(mark="base")
    for v in range(cfg["versions"] + 1):
        m = store.get(v, "snapshot") if v == 0 else store.get(v, "delta")
        clear_peak()
        mark(mark="begin", label=f"apply v{v}")
        t0 = time.perf_counter()
        cur = weights.apply([m], lambda b: store.blocks.get(b.id, b.size))
        seconds = time.perf_counter() - t0
        ok = cur.version == v and cur.state_digest == m.state_digest
        mark(mark="end", label=f"apply v{v}", hwm=hwm_bytes(),
             result={"version": v, "seconds": seconds, "current_ok": ok, "kind": m.kind})


def role_e2e(work: Path, cfg: dict) -> None:
    """A trainer daemon and two region daemons on loopback: publish -> every region current."""
    from tests.integration.harness import TOKEN, Cluster

    big = {"bittorrent": {"piece_size": 1 << 20}}
    with Cluster(work / "e2e", run=RUN) as c:
        t = c.trainer(**big)
        c.region("r1", **big)
        c.region("r2", **big)
        c.start_all()
        pub = Publisher(chain_dir=t.state_dir / "chain", key_path=c.key_path, run=RUN,
                        daemon_url=t.url, token=TOKEN,
                        snapshots=SnapshotPolicy(every=10**6, max_delta_ratio=1e9))
        for v in range(cfg["versions"] + 1):
            state = load(work, v)
            t0 = time.perf_counter()
            out = pub.publish(v, state)
            published = time.perf_counter() - t0
            if not out.notified:
                raise SystemExit(f"trainer daemon did not take v{v}:\n{t.log()}")
            c.wait_all_at(v, timeout=cfg["e2e_timeout"])
            total = time.perf_counter() - t0
            digests = {n: c.daemons[n].status()["state_digest"] for n in ("r1", "r2")}
            ok = all(d == (out.delta or out.snapshot).state_digest for d in digests.values())
            mark(result={"version": v, "publish_s": published, "end_to_end_s": total,
                         "digests_ok": ok})
            print(f"e2e: v{v} on every region in {total:.1f}s", flush=True)
            del state


def role_huge(work: Path, cfg: dict) -> None:
    """One bf16 tensor above 2^31 bytes through snapshot, delta, blocks and apply, bit-exact,
    with changes on both sides of the 2^31-byte offset and at the last element."""
    n = cfg["huge_elements"]
    cols = 4096
    rows = n // cols
    n = rows * cols
    state = {"model.embed_tokens.weight": torch.empty(rows, cols, dtype=torch.bfloat16)}
    flat = state["model.embed_tokens.weight"].view(-1)
    g = torch.Generator().manual_seed(7)
    for i in range(0, n, 1 << 26):
        j = min(n, i + (1 << 26))
        flat[i:j] = torch.randn(j - i, generator=g).mul_(0.02)
    keys.generate(work / "huge.key")
    store_dir = work / "huge" / "chain"
    pub = Publisher(chain_dir=store_dir, key_path=work / "huge.key", run="huge",
                    snapshots=SnapshotPolicy(every=10**6, max_delta_ratio=1e9))
    t0 = time.perf_counter()
    pub.publish(0, state)
    print(f"huge: v0 snapshot published in {time.perf_counter() - t0:.1f}s", flush=True)
    edge = min(1 << 30, n - 2)  # the element at byte offset 2^31 (when the tensor has one)
    where = torch.cat([torch.randint(0, n, (n // 1000,), generator=g),
                       torch.tensor([0, edge - 1, edge, edge + 1, n - 1])])
    bits = flat.view(torch.int16)
    bits[where] += 1
    t0 = time.perf_counter()
    out = pub.publish(1, state)
    print(f"huge: v1 delta ({out.changed_elements} changes) published in "
          f"{time.perf_counter() - t0:.1f}s", flush=True)
    del pub
    store = ChainStore(store_dir)
    weights = WeightsDir(work / "huge" / "weights")
    t0 = time.perf_counter()
    weights.apply([store.get(0, "snapshot")], lambda b: store.blocks.get(b.id, b.size))
    cur = weights.apply([store.get(1, "delta")], lambda b: store.blocks.get(b.id, b.size))
    print(f"huge: applied v0 and v1 in {time.perf_counter() - t0:.1f}s", flush=True)
    from chain.sources import FileSource

    got = FileSource(cur.path).bits("model.embed_tokens.weight").reshape(-1)
    want = bits.view(-1).numpy().view(got.dtype)
    exact = bool(np.array_equal(got, want))
    edge_ok = bool(np.array_equal(got[edge - 1:edge + 2], want[edge - 1:edge + 2]))
    mark(result={"huge_bytes": 2 * n, "changed": out.changed_elements,
                 "bit_exact": exact and edge_ok, "version": cur.version})


ROLES = {"gen": role_gen, "baseline": role_baseline, "publish": role_publish,
         "region": role_region, "e2e": role_e2e, "huge": role_huge}

if __name__ == "__main__":
    role, workdir = sys.argv[1], Path(sys.argv[2])
    ROLES[role](workdir, json.loads((workdir / "config.json").read_text()))
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown of GBs of tensors; every file is closed by now
