"""The small files inside a reconstructed weights directory: VERSION.json and CHANGES.

VERSION.json says which version a directory holds and every tensor's digest; it is what
`WeightsDir.current()` trusts, so a truncated or garbled one is refused with BadVersionDir,
never a bare JSON or key error. CHANGES lists, per tensor, the element positions that changed
from the previous version to this one: it is how the older of two directories is brought
forward in place by copying only those positions (a tensor listed as whole changed entirely).
"""

import json
import re
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from chain.atomic import atomic_writer, write_atomic
from chain.errors import ChainError

FORMAT = 2
"""2: digests are additive lane hashes (chain/lanehash.py); directories without a format were
written by an older deltaswarm with xxh3 digests."""
VERSION_FILE = "VERSION.json"
CHANGES_FILE = "CHANGES"
ADVANCE = "ADVANCE.json"  # in a staging dir: an older version being brought forward in place
SHARDS = "SHARDS.json"  # in a staging dir: a fresh build (its shard files)
JOURNAL = "JOURNAL"  # in a staging dir: the tensors already done
OURS = {VERSION_FILE, CHANGES_FILE, ADVANCE, SHARDS, JOURNAL, "model.safetensors.index.json"}
_MAGIC = b"DSC2"
_HEAD = struct.Struct("<4sQ")
WHOLE = -1
_DIGESTS = re.compile(r"[0-9a-f]{32}(?:,[0-9a-f]{32})*")


class BadVersionDir(ChainError):
    """A weights directory's VERSION.json or CHANGES is missing, truncated or inconsistent."""


@dataclass(frozen=True)
class VersionInfo:
    version: int
    state_digest: str
    run: str
    tensors: dict[str, str]

    def to_bytes(self) -> bytes:
        """The same bytes as `json.dumps(..., indent=1)`, with the tensor map written by the
        C string encoder: with an indent, json takes its pure-Python encoder, 0.1-0.2 s for a
        50,000-tensor VERSION.json at every apply."""
        head = json.dumps({"format": FORMAT, "version": self.version,
                           "state_digest": self.state_digest, "run": self.run,
                           "tensors": {}}, indent=1)
        if not self.tensors:
            return head.encode()
        enc = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]
        rows = ",\n  ".join(f"{enc(str(k))}: {enc(str(v))}" for k, v in self.tensors.items())
        cut = head.rindex("{}")
        return (head[:cut] + "{\n  " + rows + "\n }" + head[cut + 2:]).encode()


_KNOWN: "OrderedDict[bytes, VersionInfo]" = OrderedDict()
"""VERSION.json files this process wrote or read, by the xxh3-128 of their bytes: a region
reads its current version's (3 MB at 50,000 tensors, 20-40 ms to parse) two or three times an
apply; hashing the bytes read costs ~1 ms. Keyed by content, so an entry is never stale: a
file changed in any byte is parsed (and checked) again."""
_KNOWN_LOCK = threading.Lock()
KNOWN_FILES = 2
"""The current version's and the one being written (each ~10 MB held at 50,000 tensors)."""


def _remember(key: bytes, info: VersionInfo) -> None:
    with _KNOWN_LOCK:
        _KNOWN[key] = info
        _KNOWN.move_to_end(key)
        while len(_KNOWN) > KNOWN_FILES:
            _KNOWN.popitem(last=False)


def read_info(directory: Path) -> VersionInfo:
    """The directory's VERSION.json, checked (BadVersionDir names what is wrong). The result
    is shared with every reader of the same bytes: read it, never change it."""
    path = Path(directory) / VERSION_FILE
    try:
        raw = path.read_bytes()
        key = xxhash.xxh3_128_digest(raw)
        with _KNOWN_LOCK:
            known = _KNOWN.get(key)
        if known is not None:
            return known
        doc = json.loads(raw)
    except FileNotFoundError:
        raise BadVersionDir(f"{path} is missing: the directory is not a finished version") \
            from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BadVersionDir(f"{path} is truncated or not JSON ({e}); the directory cannot be "
                            "trusted and will be rebuilt from the chain") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else None
        raise BadVersionDir(f"{path} has format {got!r}, this build writes {FORMAT} (it was "
                            "made by another deltaswarm version); it will be rebuilt")
    try:
        tensors = doc["tensors"]
        # JSON object keys are strings; the values are checked in one C-level pass (a dict
        # comprehension converting each was 20-40 ms a read at 50,000 tensors)
        if type(tensors) is not dict or not set(map(type, tensors.values())) <= {str}:
            raise TypeError("tensors")
        # 32 lowercase hex digits each, checked in C over the joined text: a bring-forward
        # adds moves to these and would stop on a ValueError instead of copying from current
        if tensors and not _DIGESTS.fullmatch(",".join(tensors.values())):
            raise ValueError("tensors: a digest is not 32 hex digits")
        info = VersionInfo(int(doc["version"]), str(doc["state_digest"]), str(doc["run"]),
                           tensors)
    except (KeyError, TypeError, ValueError) as e:
        raise BadVersionDir(f"{path} lacks or garbles field {e}; it will be rebuilt") from None
    _remember(key, info)
    return info


def write_info(directory: Path, info: VersionInfo, mode: int | None) -> None:
    raw = info.to_bytes()
    write_atomic(Path(directory) / VERSION_FILE, raw, mode)
    _remember(xxhash.xxh3_128_digest(raw), info)


def write_changes(directory: Path, version: int, changes: dict[str, np.ndarray | None],
                  mode: int | None = None) -> None:
    """Positions changed on the way to `version`, per tensor (None: the whole tensor).
    Not fsync'd: a file lost to a power cut is noticed (checksum) and costs a full copy."""
    names = sorted(changes)
    counts = [WHOLE if changes[n] is None else int(changes[n].size) for n in names]
    # hashed and written in chunks of many tensors: per-tensor hashing and writes cost ~10 us
    # a tensor (half a second of a 50,000-tensor apply), one body would copy every position.
    # The body goes first behind a header holding a blank check of the same length, then the
    # header is written again with the check: each chunk is joined once, not once to hash it
    # and again to write it.
    listing = json.dumps({"version": version, "tensors": names, "counts": counts})

    def header(check: str) -> bytes:  # the listing made once (50,000 names: ~12 ms a dump)
        head = f'{listing[:-1]}, "check": "{check}"}}'.encode()
        return _HEAD.pack(_MAGIC, len(head)) + head

    h = xxhash.xxh3_64()
    blank = header("0" * len(h.hexdigest()))
    with atomic_writer(Path(directory) / CHANGES_FILE, mode, durable=False) as f:
        f.write(blank)
        for chunk in _chunks([changes[n] for n in names if changes[n] is not None]):
            raw = memoryview(chunk).cast("B")
            h.update(raw)
            f.write(raw)
        final = header(h.hexdigest())
        assert len(final) == len(blank)  # xxh3_64's hex digest: always 16 characters
        f.seek(0)
        f.write(final)


def _chunks(parts: list[np.ndarray], elements: int = 1 << 23) -> Iterator[np.ndarray]:
    """`parts` as contiguous int64 arrays of about `elements` each (64 MiB), in order. (Writing
    a group's members' positions as views of their one array instead, found by address,
    cost ~3 us a member where the join costs ~0.5 us.)"""
    run: list[np.ndarray] = []
    size = 0
    for p in parts:
        run.append(p)
        size += p.size
        if size >= elements:
            yield np.concatenate(run, dtype=np.int64)
            run, size = [], 0
    if run:
        yield np.concatenate(run, dtype=np.int64)


def read_changes(directory: Path, version: int) -> dict[str, np.ndarray | None] | None:
    """What write_changes stored for `version`, or None if absent, for another version, or
    damaged (the caller then copies whole tensors instead)."""
    path = Path(directory) / CHANGES_FILE
    try:
        raw = np.fromfile(path, np.uint8)
        magic, n = _HEAD.unpack(raw[: _HEAD.size].tobytes())
        if magic != _MAGIC:
            return None
        head = json.loads(raw[_HEAD.size : _HEAD.size + n].tobytes())
        if head["version"] != version:
            return None
        body = raw[_HEAD.size + n :]
        if body.size % 8 or xxhash.xxh3_64_hexdigest(memoryview(body)) != head["check"]:
            return None
        pos = body.view(np.int64)
        out: dict[str, np.ndarray | None] = {}
        at = 0
        for name, count in zip(head["tensors"], head["counts"], strict=True):
            if count == WHOLE:
                out[name] = None
            else:
                out[name] = pos[at : at + count]
                at += count
        return out if at == pos.size else None
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
