"""Publishing from a sharded trainer: every rank encodes the part of the model it holds.

    pub = ShardedPublisher(chain_dir, run="my-run", key_path="trainer.key" (rank 0 only),
                           daemon_url=..., token=...)
    for step in ...:
        ...optimizer.step()...                 # FSDP2 (fully_shard) or any sharding
        state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
        pub.publish(step + 1, state)           # every rank, same call, its own shards

A value may be a DTensor sharded along dim 0 on a 1-D mesh (FSDP2) or replicated (one rank,
chosen by name, publishes it), a plain tensor ("this rank owns it whole"), or a `Shard`
(an explicit element range, for other layouts). No rank gathers anything it does not hold:
each finds its changes on its own device, writes its own blocks into the shared chain dir and
sends the assembling rank a small report (gather_object); that rank checks the slices tile
every tensor, joins the digest parts, signs one manifest (format 3) and tells the daemon, then
every rank learns the outcome and only then moves on. A failure anywhere (a bad slice, a rank
that died) leaves the version unsigned on every rank; ranks restarted with the same weights
reuse their persisted parts. The chain dir must be reachable by every rank (one node, or a
shared filesystem), and the key is loaded and used on the assembling rank only.
"""

import logging
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import xxhash

from chain import dtypes, keys, shards
from chain.blocks import DEFAULT_BLOCK, BlockStore
from chain.codec.api import DIRECT, THREADS
from chain.digest import pieces_root
from chain.errors import ChainError
from chain.follow import publisher_retain
from chain.lease import Lease, chain_lock
from chain.manifest import BlockEntry, FileEntry, Manifest, Parent
from chain.policy import Retention, SnapshotPolicy
from chain.store import ChainStore
from trainer.changes import bits_of
from trainer.publisher import Published, notify_daemon
from trainer.rank_encoder import RankEncoder, Slice

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shard:
    """Elements [offset, offset + tensor.numel()) (row-major) of a tensor of `shape`."""

    tensor: torch.Tensor
    shape: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class ShardedPublished(Published):
    d2h_bytes: int = 0
    """Bytes the ranks copied device -> host to find the delta (positions and values)."""
    reused_ranks: tuple[int, ...] = ()
    """Ranks that reused the part they had persisted before a crash."""


def owner(name: str, world: int) -> int:
    """The rank that publishes a tensor every rank holds whole (replicated)."""
    return xxhash.xxh32_intdigest(name.encode()) % world


def _dtensor() -> type | None:
    """DTensor if anything imported it (a value can be one only then), else None: importing
    it here would cost a trainer that passes plain tensors or Shards about 40 MB of modules
    (torch.fx, sympy) on its first publish."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def local_slices(state: Mapping[str, object], rank: int, world: int) -> list[Slice]:
    """The slices this rank holds of each tensor in `state` (see the module docstring)."""
    dtensor = _dtensor()
    out = []
    for name, v in state.items():
        if isinstance(v, Shard):
            t, shape, lo = v.tensor, list(v.shape), v.offset
        elif dtensor is not None and isinstance(v, dtensor):
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor import Shard as DShard

            pl = v.placements
            shape = list(v.shape)
            if all(isinstance(p, Replicate) for p in pl):
                if owner(name, world) != rank:
                    continue
                t, lo = v.to_local(), 0
            elif v.device_mesh.ndim == 1 and isinstance(pl[0], DShard) and pl[0].dim == 0:
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                t = v.to_local()
                local_shape, offset = compute_local_shape_and_global_offset(
                    v.shape, v.device_mesh, pl)
                if list(t.shape) != list(local_shape):
                    raise ValueError(f"{name}: local shard {list(t.shape)} is not the "
                                     f"expected {list(local_shape)}")
                lo = offset[0] * math.prod(shape[1:]) if t.numel() else 0
            else:
                raise ValueError(f"{name}: placements {pl} are not supported (dim-0 shards on "
                                 "a 1-D mesh, or replicated); redistribute it first")
        elif isinstance(v, torch.Tensor):
            t, shape, lo = v, list(v.shape), 0
        else:
            raise ValueError(f"{name}: expected a tensor, DTensor or Shard, got {type(v)}")
        if lo < 0 or lo + t.numel() > math.prod(shape):
            raise ValueError(f"{name}: elements {lo}..{lo + t.numel()} lie outside its shape "
                             f"{shape}")
        out.append(Slice(name, dtypes.of_tensor(t).name, shape, lo, bits_of(t)))
    return out


def local_codec_threads() -> int:
    """Codec threads for one rank: the codec's default, fewer when the ranks on this host
    (LOCAL_WORLD_SIZE, which torchrun sets) would together ask for more threads than this
    process may use cores; oversubscribed, N ranks were slower than one on the same host."""
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(THREADS, len(os.sched_getaffinity(0)) // local))


class ShardedPublisher:
    def __init__(self, chain_dir: Path | str, run: str, *, key_path: Path | str | None = None,
                 group: dist.ProcessGroup | None = None, assembler: int = 0,
                 daemon_url: str | None = None, token: str | None = None,
                 snapshots: SnapshotPolicy | None = None, retention: Retention | None = None,
                 block_size: int = DEFAULT_BLOCK, codec_threads: int | None = None,
                 direct_positions: int = DIRECT) -> None:
        """`direct_positions`: how this rank's delta records code positions, as the
        Publisher's (chain.codec.api.DIRECT; -1, the default, ranks as older daemons read)."""
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.assembler = assembler
        self._dst = dist.get_global_rank(group, assembler) if group is not None else assembler
        chain_dir = Path(chain_dir)
        self.run = run
        self.encoder = RankEncoder(BlockStore(chain_dir / "blocks", chain_lock(chain_dir)),
                                   chain_dir / "parts", self.rank, block_size,
                                   codec_threads or local_codec_threads(), direct_positions)
        self.head: int | None = None
        if self.rank == assembler:
            if key_path is None:
                raise ValueError(f"rank {assembler} assembles and signs: give it key_path")
            self.key = keys.load_private(Path(key_path))
            self.store = ChainStore(chain_dir, self.key.public_key())
            if self.store.run() not in (None, run):
                raise ChainError(f"{chain_dir} holds run {self.store.run()!r}, not {run!r}")
            self.daemon_url = daemon_url.rstrip("/") if daemon_url else None
            self.token = token
            self.snapshots = snapshots or SnapshotPolicy()
            self.retention = retention or Retention()

    # --- collectives --------------------------------------------------------------------
    def _bcast(self, obj: object) -> object:
        box = [obj]
        dist.broadcast_object_list(box, src=self._dst, group=self.group)
        return box[0]

    def _gather(self, obj: object) -> list | None:
        out = [None] * self.world if self.rank == self.assembler else None
        dist.gather_object(obj, out, dst=self._dst, group=self.group)
        return out

    def _round(self, plan: dict, work, finish) -> dict:
        """Broadcast `plan`; every rank runs `work(plan)` -> RankPart (an error becomes the
        part's `error`, so every rank still reaches the gather); the assembler runs
        `finish(plan, parts)`; everyone gets its outcome, or the same ChainError."""
        plan = self._bcast(plan)
        if plan.get("error"):
            raise ChainError(plan["error"])
        try:
            part = work(plan)
        except Exception as e:  # reported to the assembler, raised on every rank below
            part = shards.RankPart(rank=self.rank, version=max(0, plan["version"]),
                                   parent_digest=None,
                                   slices=[], error=f"rank {self.rank}: {e}")
        parts = self._gather(part)
        outcome: dict = {}
        if self.rank == self.assembler:
            bad = [p.error for p in parts if p.error]
            try:
                if bad:
                    raise ChainError("; ".join(bad))
                outcome = {"ok": finish(plan, parts)}
            except Exception as e:  # every rank must hear of it
                outcome = {"error": f"v{plan['version']} not published: {e}"}
        outcome = self._bcast(outcome)
        if "error" in outcome:
            self.encoder.discard()
            raise ChainError(outcome["error"])
        self.encoder.commit()
        return outcome["ok"]

    # --- resume ---------------------------------------------------------------------------
    def resume(self, state: Mapping[str, object]) -> int:
        """Adopt each rank's `state` as the head version after a restart (every rank calls
        it); the joined digests must equal the head's, else ChainError on every rank."""
        plan = {"version": -1}
        if self.rank == self.assembler:
            head = self.store.head()
            plan = {"version": head if head is not None else -1, "error": None if head is not None
                    else "nothing published yet; nothing to resume from"}

        def finish(plan: dict, parts: list[shards.RankPart]) -> int:
            m = self._manifest(plan["version"])
            got = {t.name: t.digest for t in shards.tensor_entries(parts)}
            if got != {t.name: t.digest for t in m.tensors}:
                raise ChainError(f"the weights given to resume() are not v{m.version} as "
                                 "published; restore every rank's checkpoint of that version")
            self.encoder.forget_parts(m.version)
            return m.version

        self.head = self._round(plan, lambda p: self.encoder.adopt(
            local_slices(state, self.rank, self.world)), finish)
        return self.head

    def _manifest(self, version: int) -> Manifest:
        return self.store.get(version, "delta") or self.store.get(version, "snapshot")

    # --- publish --------------------------------------------------------------------------
    def publish(self, version: int, state: Mapping[str, object],
                files: Mapping[str, bytes] | None = None) -> ShardedPublished:
        """Every rank calls this with its own shards of the same version. `files` (config,
        tokenizer) are taken from the assembling rank."""
        t0 = time.perf_counter()
        plan: dict = {"version": version}
        lease = None
        if self.rank == self.assembler:
            plan = self._plan(version)
            if not plan["error"]:  # taken before any rank writes a block of this version
                try:
                    lease = self.store.writing(version).acquire()
                except OSError as e:  # every rank must hear of it (the plan's error)
                    plan["error"] = f"v{version} not published: its write lease failed: {e}"

        def work(plan: dict) -> shards.RankPart:
            if plan["head"] != self.head:
                raise ChainError(f"it holds v{self.head}, the chain's head is v{plan['head']}: "
                                 "call resume() with the head's weights first")
            return self.encoder.encode(version, local_slices(state, self.rank, self.world),
                                       parent_digest=plan["parent"], snapshot=plan["snapshot"])

        try:
            out = self._round(plan, work,
                              lambda plan, parts: self._finish(plan, parts, files, t0, lease))
        finally:
            if lease is not None:
                lease.release()
        self.head = version
        return out

    def _plan(self, version: int) -> dict:
        head = self.store.head()
        plan = {"version": version, "head": head, "parent": None, "snapshot": True,
                "error": None}
        if head is not None and version != head + 1:
            plan["error"] = f"version {version} does not follow the head v{head}"
        elif head is not None:
            plan["parent"] = self._manifest(head).state_digest
            plan["snapshot"] = self.snapshots.due(version, self.store.manifests())
        return plan

    def _finish(self, plan: dict, parts: list[shards.RankPart],
                files: Mapping[str, bytes] | None, t0: float,
                lease: Lease | None = None) -> ShardedPublished:
        version = plan["version"]
        tensors = shards.tensor_entries(parts)
        file_entries = []
        for fname, data in sorted((files or {}).items()):
            bid = self.store.blocks.put(data)
            file_entries.append((FileEntry(name=fname, block=bid, size=len(data)),
                                 BlockEntry(id=bid, size=len(data), root=pieces_root(data))))
        elements = sum(t.numel for t in tensors)
        changed = sum(s.changed for p in parts for s in p.slices)
        stats = {"tensors": len(tensors), "elements": elements, "changed_elements": changed,
                 "encoded_bytes": sum(p.encoded_bytes for p in parts),
                 "dense_bytes": sum(t.nbytes for t in tensors), "ranks": self.world,
                 "d2h_bytes": sum(p.d2h_bytes for p in parts),
                 "seconds": round(max(p.seconds for p in parts), 4)}
        common = dict(run=self.run, version=version, tensors=tensors, files=file_entries,
                      stats=stats)
        delta = snapshot = None
        if plan["parent"] is not None:
            parent = Parent(version=plan["head"], state_digest=plan["parent"])
            delta = shards.assemble(parts, kind="delta", parent=parent, **common).signed(self.key)
        if plan["snapshot"]:
            snapshot = shards.assemble(parts, kind="snapshot", parent=None, **common
                                       ).signed(self.key)
        for m in (delta, snapshot):  # both signed before either is stored
            if m is not None:
                self.store.add(m)
        if lease is not None:  # stored: retention below (and the daemon's) need not spare it
            lease.release()
        notified = notify_daemon(self.daemon_url, self.token, version)
        try:  # the version is published now: housekeeping must not make the ranks think not
            publisher_retain(self.store, self.retention, daemon=self.daemon_url is not None,
                             notified=notified)
            self.encoder.forget_parts(version)
        except OSError as e:
            log.warning("v%d published; cleaning up after it failed: %s", version, e)
        return ShardedPublished(
            version=version, delta=delta, snapshot=snapshot, changed_elements=changed,
            elements=elements, delta_bytes=delta.payload_bytes if delta else 0,
            dense_bytes=stats["dense_bytes"], seconds=time.perf_counter() - t0,
            notified=notified, d2h_bytes=stats["d2h_bytes"],
            reused_ranks=tuple(p.rank for p in parts if p.reused))
