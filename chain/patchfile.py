"""A version's changes as one small file: what a region hands its engines instead of a version dir.

The region decodes a delta once; each engine then patches its live weights from this file, in
O(changes), before the version directory on disk is brought forward. The file is a plain
safetensors file (so vLLM's venv reads it with `safetensors` alone): per changed tensor
`NAME::indices` (int64 flat element positions in the checkpoint tensor, ascending) and
`NAME::values` (the new elements, in the tensor's own dtype). Its metadata names the version,
its parent, both state digests and, per patched tensor, the parent's and the new tensor
digest (chain.lanehash, additive), so an engine can check a patch from the words it touched.
"""

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from chain.atomic import atomic_writer
from chain.dtypes import FROM_SAFETENSORS, SAFETENSORS_NAME, lookup
from chain.errors import ChainError

INDICES, VALUES = "::indices", "::values"
PATCH_FORMAT = "deltaswarm-patch-1"


class BadPatch(ChainError):
    """A patch file that is not one, or does not fit what it claims."""


@dataclass
class TensorPatch:
    name: str
    dtype: str                 # chain dtype name (bfloat16, float32, ...)
    shape: list[int]
    indices: np.ndarray        # int64, ascending flat positions
    values: np.ndarray         # bit patterns (the dtype's unsigned view), same length
    parent_digest: str
    digest: str


@dataclass
class Patch:
    version: int
    parent: int
    parent_state_digest: str
    state_digest: str
    tensors: list[TensorPatch]

    @property
    def elements(self) -> int:
        return sum(int(t.indices.size) for t in self.tensors)


def write_patch(path: Path, patch: Patch, mode: int | None = None) -> Path:
    """Write `patch` atomically (temporary file, rename); not fsync'd: it is rebuilt from the
    verified blocks if lost."""
    header: dict = {}
    shapes, dtypes, digests, parents = {}, {}, {}, {}
    chunks: list[np.ndarray] = []
    off = 0
    for t in sorted(patch.tensors, key=lambda t: t.name):
        idx = np.ascontiguousarray(t.indices, np.int64)
        val = np.ascontiguousarray(t.values, lookup(t.dtype).uint)
        if idx.shape != val.shape or idx.ndim != 1:
            raise BadPatch(f"{t.name}: {idx.size} positions for {val.size} values")
        for key, arr, st in ((t.name + INDICES, idx, "I64"),
                             (t.name + VALUES, val, SAFETENSORS_NAME[t.dtype])):
            header[key] = {"dtype": st, "shape": [int(arr.size)],
                           "data_offsets": [off, off + arr.nbytes]}
            off += arr.nbytes
            chunks.append(arr)
        shapes[t.name], dtypes[t.name] = list(t.shape), t.dtype
        digests[t.name], parents[t.name] = t.digest, t.parent_digest
    header["__metadata__"] = {
        "format": PATCH_FORMAT, "version": str(patch.version), "parent": str(patch.parent),
        "parent_state_digest": patch.parent_state_digest, "state_digest": patch.state_digest,
        "shapes": json.dumps(shapes), "dtypes": json.dumps(dtypes),
        "digests": json.dumps(digests), "parent_digests": json.dumps(parents)}
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    with atomic_writer(Path(path), mode, durable=False) as f:
        f.write(struct.pack("<Q", len(body)))
        f.write(body)
        for arr in chunks:
            f.write(memoryview(arr).cast("B"))
    return Path(path)


def _ascending(idx: np.ndarray, step: int = 1 << 20) -> bool:
    """Whether `idx` is strictly ascending (so, with its ends in range, every position is):
    the engines' kernels write at these positions and count each word once, in order. A
    million at a time, so the comparison reuses memory instead of faulting in fresh pages."""
    for lo in range(0, idx.size - 1, step):
        part = idx[lo:lo + step + 1]
        if not (part[1:] > part[:-1]).all():
            return False
    return True


def read_patch(path: Path) -> Patch:
    """The patch in `path`, checked for shape: every tensor has positions and values of one
    length, positions strictly ascending and inside the tensor; a BadPatch names what does not
    fit.

    The arrays are a private (copy-on-write) map of the file, not a copy: reading 100 MB into
    fresh memory cost 0.25 s of page faults here, more than the patch itself. A map is safe
    because a patch file is never rewritten in place (written to a temporary name and renamed;
    retention unlinks it, which leaves a map intact), so no reader can be cut off mid-read."""
    path = Path(path)
    try:
        raw = np.memmap(path, np.uint8, mode="c").view(np.ndarray)
        (n,) = struct.unpack("<Q", raw[:8].tobytes())
        header = json.loads(raw[8 : 8 + n].tobytes())
        meta = header.pop("__metadata__")
        if meta.get("format") != PATCH_FORMAT:
            raise BadPatch(f"{path}: not a deltaswarm patch (format {meta.get('format')!r})")
        shapes, dtypes = json.loads(meta["shapes"]), json.loads(meta["dtypes"])
        digests, parents = json.loads(meta["digests"]), json.loads(meta["parent_digests"])
        data = raw[8 + n :]
        tensors = []
        for name in sorted(shapes):
            arrays = []
            for key, chain_dtype, want in (
                    (name + INDICES, "int64", np.dtype(np.int64)),
                    (name + VALUES, dtypes[name], lookup(dtypes[name]).uint)):
                e = header[key]
                if FROM_SAFETENSORS.get(e["dtype"]) != chain_dtype:
                    raise BadPatch(f"{path}: {key} has dtype {e['dtype']}, not {chain_dtype}")
                a, b = e["data_offsets"]
                if not 0 <= a <= b <= data.size or (b - a) != want.itemsize * e["shape"][0]:
                    raise BadPatch(f"{path}: {key}'s data offsets {a}..{b} do not fit its "
                                   f"shape {e['shape']} in a body of {data.size} bytes")
                arrays.append(data[a:b].view(want))
            idx, val = arrays
            numel = int(np.prod(shapes[name], dtype=np.int64))
            if idx.size != val.size or (idx.size and (idx[0] < 0 or idx[-1] >= numel)):
                raise BadPatch(f"{path}: {name} has positions outside its {numel} elements")
            if not _ascending(idx):
                raise BadPatch(f"{path}: {name}'s positions are not strictly ascending")
            tensors.append(TensorPatch(name, dtypes[name], list(shapes[name]), idx, val,
                                       parents[name], digests[name]))
        return Patch(int(meta["version"]), int(meta["parent"]), meta["parent_state_digest"],
                     meta["state_digest"], tensors)
    except BadPatch:
        raise
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise BadPatch(f"{path}: unreadable patch ({type(e).__name__}: {e})") from None
