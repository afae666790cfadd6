"""The publisher: how any trainer ("bring your own trainer") hands a new policy version to the
swarm.

    pub = Publisher(chain_dir="/var/lib/deltaswarm/trainer/chain", key_path="trainer.key",
                    run="my-run", daemon_url="http://127.0.0.1:7600", token="...")
    for step in range(...):
        ...optimizer.step()...
        pub.publish(step + 1, {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})

Each call encodes the change against the last published version, writes blocks and a signed
manifest (plus a snapshot when the policy says so) through `chain`, and tells the local daemon
over HTTP to seed it. The daemon also picks up anything in the chain dir when it starts, so a
daemon that was down misses nothing. Retention is the daemon's decision whenever it recorded
one (chain.follow): the publisher's own `retention` applies only to a chain dir no daemon
serves. A write lease (chain.lease) covers each version from its first block to its stored
manifests, so the daemon's retention never deletes what is being written.

Cost per delta version: one encode pass over old and new (it finds the changes), then
O(changes): the tensor digests are the head's moved by the changes, and the one kept CPU copy
of the head is patched at the changed positions once the version is stored. Tensors already
on the CPU and contiguous are read in place; others are copied one at a time. Memory beyond
the caller's tensors: that copy (1x the model) plus the changes. A snapshot version hashes
every tensor once (a full pass, at memory bandwidth).
"""

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from chain import codec, keys
from chain.adapters import ADAPTER_CONFIG, check_config
from chain.blocks import DEFAULT_BLOCK
from chain.errors import ChainError
from chain.follow import publisher_retain
from chain.gcpause import without_gc
from chain.manifest import BasePin, Manifest
from chain.policy import Retention, SnapshotPolicy
from chain.sizes import Sizes
from chain.sources import StateDictSource, source_digest
from chain.store import ChainStore
from chain.writer import GROUP_BELOW, write_artifact

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Published:
    version: int
    delta: Manifest | None
    snapshot: Manifest | None
    changed_elements: int
    elements: int
    delta_bytes: int
    """All the delta's blocks: tensors and carried files (0: no delta, version 0)."""
    dense_bytes: int
    seconds: float
    notified: bool

    @property
    def density(self) -> float:
        return self.changed_elements / max(1, self.elements)

    @property
    def delta_tensor_bytes(self) -> int:
        """Of delta_bytes, the tensor payload: what "x smaller than dense" is computed on."""
        return Sizes.of(self.delta).tensor_bytes if self.delta else 0

    @property
    def delta_file_bytes(self) -> int:
        """Of delta_bytes, the carried files (config, tokenizer, ...), which every version
        lists; unchanged ones are the same blocks as the version before (chain/sizes.py)."""
        return Sizes.of(self.delta).file_bytes if self.delta else 0


class Publisher:
    def __init__(
        self,
        chain_dir: Path | str,
        key_path: Path | str,
        run: str,
        daemon_url: str | None = None,
        token: str | None = None,
        snapshots: SnapshotPolicy | None = None,
        retention: Retention | None = None,
        block_size: int = DEFAULT_BLOCK,
        base: BasePin | None = None,
        direct_positions: int = codec.DIRECT,
        group_below: int = GROUP_BELOW,
    ) -> None:
        """`base`: this run publishes LoRA adapters (PEFT tensors, with adapter_config.json in
        each version's `files`) over that version of another chain (chain/adapters.py).
        `direct_positions`: how deltas code positions (chain.codec.api.DIRECT: -1 the most
        compact; N >= 0 lets a region decode a segment in O(changes) where that costs at most
        N % more bytes). `group_below`: tensors of fewer elements travel in group records
        (chain.writer.GROUP_BELOW; 0 for regions running a deltaswarm from before them)."""
        self.key = keys.load_private(Path(key_path))
        self.store = ChainStore(Path(chain_dir), self.key.public_key())
        self.run = run
        self.daemon_url = daemon_url.rstrip("/") if daemon_url else None
        self.token = token
        self.snapshots = snapshots or SnapshotPolicy()
        self.retention = retention or Retention()
        self.block_size = block_size
        self.base = base
        self.direct_positions = direct_positions
        self.group_below = group_below
        self._last: dict[str, torch.Tensor] | None = None
        self._views: dict = {}
        """Bit views of `_last`'s tensors (chain.sources.StateDictSource `views`)."""
        self._spans: dict = {}
        """Groups of `_last`'s tensors found back to back (StateDictSource `spans`), kept
        while every tensor of `_last` is the object they were found over."""
        self._metas: tuple | None = None
        """`_last`'s dtypes and shapes (StateDictSource `metas_found`), kept as `_spans` are."""
        if self.store.run() not in (None, run):
            raise ChainError(f"{chain_dir} holds run {self.store.run()!r}, not {run!r}; use a "
                             "fresh chain dir or the same run name")

    @property
    def head(self) -> int | None:
        return self.store.head()

    def resume(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        """Adopt `state_dict` as the last published state after a restart; it must be
        bit-identical to the head version (checked by state digest)."""
        head = self.store.head()
        if head is None:
            raise ChainError("nothing published yet; nothing to resume from")
        manifest = self.store.get(head, "delta") or self.store.get(head, "snapshot")
        state = _cpu_copy(state_dict)
        if source_digest(StateDictSource(state)) != manifest.state_digest:
            raise ChainError(
                f"the weights given to resume() are not v{head} as published; restore the "
                "trainer checkpoint saved with that version"
            )
        self._last, self._views, self._spans, self._metas = state, {}, {}, None
        return head

    @without_gc
    def publish(self, version: int, state_dict: Mapping[str, torch.Tensor],
                files: Mapping[str, bytes] | None = None) -> Published:
        head = self.store.head()
        if head is not None and version != head + 1:
            raise ChainError(f"version {version} does not follow the head v{head}; versions "
                             "must increase by one")
        if head is not None and self._last is None:
            raise ChainError("call resume(state_dict) with the head's weights before publishing")
        if self.base is not None:
            if ADAPTER_CONFIG not in (files or {}):
                raise ChainError(f"an adapter version needs its {ADAPTER_CONFIG} in `files` "
                                 "(PEFT's save_pretrained writes it)")
            check_config(files[ADAPTER_CONFIG])
        t0 = time.perf_counter()
        new = StateDictSource(state_dict)
        delta = snapshot = None
        changes: dict[str, codec.Changes | None] = {}
        groups: list[tuple[list[str], np.ndarray, codec.Changes]] = []
        common = dict(run=self.run, version=version, new=new, files=files,
                      block_size=self.block_size, base=self.base)
        with self.store.writing(version):
            if head is not None:
                assert self._last is not None
                parent_m = self.store.get(head, "delta") or self.store.get(head, "snapshot")
                kept = StateDictSource(self._last, self._views, owned=True,
                                       spans=self._spans, metas=self._metas)
                delta, stats = write_artifact(self.store.blocks, self.key, kind="delta",
                                              parent=kept, parent_manifest=parent_m,
                                              trust_parent=True,
                                              on_changes=changes.__setitem__,
                                              on_group=lambda *g: groups.append(g),
                                              direct_positions=self.direct_positions,
                                              group_below=self.group_below, **common)
                self.store.add(delta)
                # the head moved: bring the kept copy along now, whatever happens next
                same = not _replaces(self._last, state_dict, changes)
                self._last = _patched(self._last, kept, state_dict, changes, groups)
                # none replaced: the views and the groups' spans found this time hold next time
                # (a walk over 50,000 tensors not made again); else only views of tensors kept:
                # one of a dropped or replaced tensor would hold it alive (a retyped model:
                # two copies) until the next publish
                self._spans = kept.spans if same else {}
                self._metas = kept.metas_found if same else None
                self._views = kept.views if same else {
                    k: v for k, v in (kept.views or {}).items() if self._last.get(k) is v[0]}
            if head is None or self.snapshots.due(version, self.store.manifests()):
                snapshot, snap_stats = write_artifact(self.store.blocks, self.key, kind="snapshot",
                                                      same_tensors_as=delta, **common)
                self.store.add(snapshot)
                if delta is None:
                    stats = snap_stats
                    self._last, self._views, self._spans = _cpu_copy(state_dict), {}, {}
                    self._metas = None
        notified = self._notify(version)
        self._retain(notified)
        return Published(
            version=version, delta=delta, snapshot=snapshot,
            changed_elements=stats.changed_elements, elements=stats.elements,
            delta_bytes=delta.payload_bytes if delta else 0, dense_bytes=stats.dense_bytes,
            seconds=time.perf_counter() - t0, notified=notified,
        )

    def _retain(self, notified: bool) -> None:
        """Retention after a publish: the one rule of chain.follow (the daemon's decision
        whenever it recorded one)."""
        publisher_retain(self.store, self.retention, daemon=self.daemon_url is not None,
                         notified=notified)

    def _notify(self, version: int) -> bool:
        return notify_daemon(self.daemon_url, self.token, version)


def notify_daemon(daemon_url: str | None, token: str | None, version: int) -> bool:
    """Tell the local daemon to seed `version` (False if there is none or it did not answer:
    it picks the version up from the chain dir when it (re)starts)."""
    if daemon_url is None:
        return False
    req = urllib.request.Request(
        f"{daemon_url}/v1/publish", data=json.dumps({"version": version}).encode(),
        headers={"Content-Type": "application/json",
                 **({"Authorization": f"Bearer {token}"} if token else {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError) as e:
        log.warning("daemon at %s did not take v%d (%s); it will seed it when it (re)starts",
                    daemon_url, version, e)
        return False


def _cpu_copy(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CPU copy of `state` in one allocation, tensors back to back in name order (each
    from an 8-byte boundary), as the writer reads them: a group record's parent elements
    are then one view of it, not a copy (chain.writer.end_to_end). Tensors `_patched`
    later replaces (new, reshaped, retyped) are held apart; the bytes of those and of dropped
    ones stay in the allocation until `_compacted` copies the rest out."""
    plain = sorted(k for k, t in state.items() if t.layout == torch.strided and
                   not t.is_quantized)
    # sparse or quantized tensors (not weights an RL trainer publishes) are copied apart
    out = {k: t.detach().to("cpu", copy=True).contiguous() for k, t in state.items()
           if t.layout != torch.strided or t.is_quantized}
    starts, at = [], 0
    for k in plain:  # each from a multiple of 8 bytes and of its element size
        align = max(8, state[k].element_size())
        at = -(-at // align) * align
        starts.append(at)
        at += state[k].numel() * state[k].element_size()
    flat = torch.empty(at, dtype=torch.uint8)
    for name, start in zip(plain, starts, strict=True):
        t = state[name].detach()
        view = flat[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        out[name] = view
    return out


def _patched(last: dict[str, torch.Tensor], kept: StateDictSource,
             state: Mapping[str, torch.Tensor], changes: Mapping[str, "codec.Changes | None"],
             groups: "list[tuple[list[str], np.ndarray, codec.Changes]]" = ()
             ) -> dict[str, torch.Tensor]:
    """The kept copy `last` moved to `state`: changed positions written in place through
    `kept` (its source, holding their bit views; O(changes)), a group record's at once
    (`groups`, the writer's on_group); new, reshaped or retyped tensors copied; tensors no
    longer in `state` dropped."""
    # every tensor of `state` was reported: alone in `changes` (None: a full record) or with
    # its group, in place
    copied = {name: state[name].detach().to("cpu", copy=True).contiguous()
              for name, c in changes.items() if c is None}
    # none copied and as many tensors: the same names (a name new to `last` is a full
    # record), so `last` itself, not a new dict of 50,000 entries
    out = last if not copied and len(state) == len(last) else \
        {name: copied[name] if name in copied else last[name] for name in state}
    kept.patch([(name, c) for name, c in changes.items() if c is not None and c.pos.size],
               groups)
    return _compacted(out) if _replaces(last, state, changes) else out


def _replaces(last: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
              changes: Mapping[str, "codec.Changes | None"]) -> bool:
    """Whether moving the kept copy `last` to `state` replaces any of its tensors: one new,
    retyped or reshaped (a full record, None in `changes`) or dropped. Else the patched copy
    holds the same tensor objects, so their views and spans hold for the next version. Only
    tensors coded alone are in `changes`: O(those), not O(tensors)."""
    return len(state) != len(last) or any(c is None for c in changes.values())


def _compacted(kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`kept` after a version replaced or dropped tensors: copied into one new allocation
    when less than half of an allocation its tensors share still holds kept tensors, so the
    kept copy stays within about 1.5x the model (and groups read their parents in place
    again); else as it is."""
    live: dict[int, int] = {}
    size: dict[int, int] = {}
    for t in kept.values():
        storage = t.untyped_storage()
        key = storage.data_ptr()
        live[key] = live.get(key, 0) + t.numel() * t.element_size()
        size[key] = storage.nbytes()
    if all(2 * live[k] >= size[k] for k in live):
        return kept
    return _cpu_copy(kept)
