"""BitTorrent v2 torrents over an artifact's content-addressed blocks, built and checked in Python.

One v2-only torrent per artifact (`v00000005.delta`), always a directory: the torrent's files are
`<artifact>/ab/<id>`, so a downloader's `save_path` holds each block at
`block_path(save_path, artifact, id)`. The info dict holds only the name, piece length and each
file's length and pieces root, so it is a pure function of (artifact, manifest blocks, piece size):
`expected_info_hash` computes it from the signed manifest alone, and `check_torrent_against` refuses
a torrent from a peer whose files, sizes, pieces roots or piece layers differ from what it pins.
"""

import hashlib
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

from chain.digest import pieces_root

LEAF = 16 * 1024
_ZERO = b"\0" * 32
_ID = re.compile(r"[0-9a-f]{32}")

Block = tuple[str, int, str]  # (id, size, pieces root hex) as a manifest pins it


class BadTorrent(ValueError):
    """A torrent's bytes are malformed or do not match what the signed manifest pins."""


def block_path(save_path: str | os.PathLike, artifact: str, block: str) -> Path:
    """Where a torrent's block lands under a downloader's (or seed's) save_path."""
    return Path(save_path) / artifact / block[:2] / block


def make_torrent(artifact: str, block_paths: Sequence[tuple[str, str | os.PathLike]]
                 | Sequence[tuple[str, str | os.PathLike, str]],
                 piece_size: int = 1 << 18) -> bytes:
    """Bencoded v2-only torrent over the block files; same blocks and piece size → same bytes.

    `block_paths` is (block id, path of its file[, pieces root hex]) in any order; duplicates of
    one id are merged. The pieces root is the manifest's (`chain.digest.pieces_root`, the one
    BEP 52 root in the project); given, it is not recomputed, and only blocks larger than a
    piece are hashed here, for their piece layer (`check_torrent_against` ties layer to root).
    """
    _check_piece_size(piece_size)
    _check_name(artifact)
    entries: dict[str, tuple[int, bytes, bytes]] = {}
    for block, path, *given in block_paths:
        _check_id(block)
        data = Path(path).read_bytes()
        root = bytes.fromhex(given[0] if given else pieces_root(data))
        layer = _piece_layer(data, piece_size) if len(data) > piece_size else b""
        entries[block] = (len(data), root, layer)
    if not entries:
        raise BadTorrent(f"{artifact}: no blocks given; an artifact needs at least one block")
    info = _info(artifact, piece_size, {b: (n, r) for b, (n, r, _) in entries.items()})
    layers = {r: layer for n, r, layer in entries.values() if n > piece_size}
    return bencode({b"info": info, b"piece layers": layers})


def info_hash(torrent_bytes: bytes) -> str:
    """v2 info-hash (SHA-256 of the bencoded info dict) as 64 hex digits."""
    return hashlib.sha256(bencode(_decode_torrent(torrent_bytes)[b"info"])).hexdigest()


def expected_info_hash(artifact: str, blocks: Iterable[Block], piece_size: int) -> str:
    """The v2 info-hash the torrent of these manifest blocks must have, without any block data."""
    _check_piece_size(piece_size)
    tree = {}
    for block, size, root in blocks:
        _check_id(block)
        tree[block] = (size, bytes.fromhex(root) if size else b"")
    return hashlib.sha256(bencode(_info(artifact, piece_size, tree))).hexdigest()


def check_torrent_against(torrent_bytes: bytes, expected_blocks: Iterable[Block],
                          artifact: str | None = None) -> None:
    """Raise BadTorrent unless the torrent holds exactly the expected blocks (id, size, pieces
    root) under `<artifact>/ab/<id>`, with piece layers that hash up to each pinned root."""
    top = _decode_torrent(torrent_bytes)
    info = top[b"info"]
    name = _get(info, b"name", bytes).decode("utf-8", "replace")
    if artifact is not None and name != artifact:
        raise BadTorrent(f"torrent is named {name!r}, expected {artifact!r}")
    piece_size = _get(info, b"piece length", int)
    _check_piece_size(piece_size)
    if info.get(b"meta version") != 2:
        raise BadTorrent(f"{name}: not a v2 torrent (meta version {info.get(b'meta version')!r})")
    have = _files(info, name)
    want = {b: (s, r) for b, s, r in expected_blocks}
    missing, extra = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
    if missing or extra:
        raise BadTorrent(f"{name}: torrent files differ from the manifest: missing {missing[:3]}"
                         f"{'…' if len(missing) > 3 else ''}, extra {extra[:3]}"
                         f"{'…' if len(extra) > 3 else ''}; refuse this torrent and its peer")
    layers = top.get(b"piece layers", {})
    if not isinstance(layers, dict):
        raise BadTorrent(f"{name}: 'piece layers' is not a dictionary")
    for block, (size, root) in sorted(want.items()):
        got_size, got_root = have[block]
        if got_size != size:
            raise BadTorrent(f"{name}: block {block} is {got_size} bytes in the torrent, "
                             f"the manifest pins {size}")
        if got_root.hex() != (root if size else ""):
            raise BadTorrent(f"{name}: block {block} has pieces root {got_root.hex()} in the "
                             f"torrent, the manifest pins {root}")
        if size > piece_size:
            layer = layers.get(got_root)
            if not isinstance(layer, bytes):
                raise BadTorrent(f"{name}: no piece layer for block {block}")
            if _layer_root(layer, size, piece_size) != got_root:
                raise BadTorrent(f"{name}: the piece layer of block {block} does not hash up to "
                                 f"its pieces root")


def torrent_blocks(torrent_bytes: bytes) -> tuple[str, dict[str, int]]:
    """(name, {block id: size}) of a torrent made by make_torrent; BadTorrent otherwise."""
    info = _decode_torrent(torrent_bytes)[b"info"]
    name = _get(info, b"name", bytes).decode("utf-8", "replace")
    return name, {b: size for b, (size, _) in _files(info, name).items()}


def link_blocks(artifact: str, block_paths: Sequence[tuple[str, str | os.PathLike]],
                save_path: str | os.PathLike) -> Path:
    """Lay the blocks out under save_path as a seed needs them (hard links; copies across
    filesystems). Returns the artifact's directory."""
    for block, src in block_paths:
        _check_id(block)
        dst = block_path(save_path, artifact, block)
        if dst.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{block}.{os.getpid()}.tmp")
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    return Path(save_path) / artifact


def bencode(value: object) -> bytes:
    out: list[bytes] = []
    _bencode(value, out)
    return b"".join(out)


def bdecode(data: bytes) -> object:
    try:
        value, end = _bdecode(data, 0)
    except (IndexError, ValueError, RecursionError) as exc:
        raise BadTorrent(f"malformed bencoding: {exc}") from None
    if end != len(data):
        raise BadTorrent(f"malformed bencoding: {len(data) - end} trailing bytes")
    return value


def _info(artifact: str, piece_size: int, tree: dict[str, tuple[int, bytes]]) -> dict:
    leaves = {}
    for block in sorted(tree):
        size, root = tree[block]
        leaf = {b"length": size} | ({b"pieces root": root} if size else {})
        leaves.setdefault(block[:2].encode(), {})[block.encode()] = {b"": leaf}
    return {b"file tree": leaves, b"meta version": 2, b"name": artifact.encode(),
            b"piece length": piece_size}


def _files(info: dict, name: str) -> dict[str, tuple[int, bytes]]:
    tree = _get(info, b"file tree", dict)
    out = {}
    for prefix, sub in tree.items():
        if not isinstance(sub, dict):
            raise BadTorrent(f"{name}: file {prefix!r} sits at the top level, expected ab/<id>")
        for fname, node in sub.items():
            block = fname.decode("ascii", "replace")
            leaf = node.get(b"") if isinstance(node, dict) else None
            if not isinstance(leaf, dict) or len(node) != 1 or not _ID.fullmatch(block) \
                    or prefix != fname[:2]:
                raise BadTorrent(f"{name}: unexpected path {prefix!r}/{fname!r}, "
                                 f"expected ab/<32 hex id>")
            size = _get(leaf, b"length", int)
            root = leaf.get(b"pieces root", b"")
            if size < 0 or not isinstance(root, bytes) or len(root) not in (0, 32):
                raise BadTorrent(f"{name}: block {block} has a bad length or pieces root")
            out[block] = (size, root)
    return out


def _piece_layer(data: bytes, piece_size: int) -> bytes:
    """BEP 52 piece layer of one file: the root of each piece's subtree of 16 KiB leaves, the
    last piece's zero-padded to a full piece."""
    view = memoryview(data)
    leaves = [hashlib.sha256(view[i:i + LEAF]).digest() for i in range(0, len(view), LEAF)]
    per_piece = piece_size // LEAF
    return b"".join(_root(leaves[i:i + per_piece], per_piece)
                    for i in range(0, len(leaves), per_piece))


def _layer_root(layer: bytes, size: int, piece_size: int) -> bytes:
    pieces = -(-size // piece_size)
    if len(layer) != 32 * pieces:
        raise BadTorrent(f"piece layer holds {len(layer) // 32} hashes, the file has {pieces}")
    pad = _root([], piece_size // LEAF)
    hashes = [layer[i:i + 32] for i in range(0, len(layer), 32)]
    width = _pow2(len(hashes))
    hashes += [pad] * (width - len(hashes))
    return _root(hashes, width)


def _root(hashes: list[bytes], width: int) -> bytes:
    layer = hashes + [_ZERO] * (width - len(hashes))
    while len(layer) > 1:
        layer = [hashlib.sha256(layer[i] + layer[i + 1]).digest() for i in range(0, len(layer), 2)]
    return layer[0]


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _decode_torrent(torrent_bytes: bytes) -> dict:
    raw = bytes(torrent_bytes)
    top = bdecode(raw)
    if not isinstance(top, dict) or not isinstance(top.get(b"info"), dict):
        raise BadTorrent("not a torrent: no 'info' dictionary")
    if bencode(top) != raw:
        raise BadTorrent("torrent is not in canonical bencoding (unsorted keys or padded numbers)")
    return top


def _get(d: dict, key: bytes, kind: type):
    value = d.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise BadTorrent(f"torrent field {key.decode()!r} is missing or not {kind.__name__}")
    return value


def _check_piece_size(piece_size: int) -> None:
    if piece_size < LEAF or piece_size & (piece_size - 1):
        raise BadTorrent(f"piece size {piece_size} must be a power of two >= {LEAF}")


def _check_name(artifact: str) -> None:
    if not artifact or "/" in artifact or artifact in (".", "..") or artifact.startswith("."):
        raise BadTorrent(f"artifact name {artifact!r} cannot be a directory name")


def _check_id(block: str) -> None:
    if not _ID.fullmatch(block):
        raise BadTorrent(f"block id {block!r} is not 32 lowercase hex digits")


def _bencode(v: object, out: list[bytes]) -> None:
    if isinstance(v, bool) or not isinstance(v, int | bytes | str | list | tuple | dict):
        raise TypeError(f"cannot bencode {type(v).__name__}")
    if isinstance(v, int):
        out.append(b"i%de" % v)
    elif isinstance(v, bytes | str):
        raw = v.encode() if isinstance(v, str) else v
        out.append(b"%d:" % len(raw))
        out.append(raw)
    elif isinstance(v, list | tuple):
        out.append(b"l")
        for item in v:
            _bencode(item, out)
        out.append(b"e")
    else:
        out.append(b"d")
        for key in sorted(v):
            _bencode(key, out)
            _bencode(v[key], out)
        out.append(b"e")


def _bdecode(data: bytes, i: int) -> tuple[object, int]:
    c = data[i:i + 1]
    if c == b"i":
        end = data.index(b"e", i)
        return int(data[i + 1:end]), end + 1
    if c == b"l":
        i, items = i + 1, []
        while data[i:i + 1] != b"e":
            item, i = _bdecode(data, i)
            items.append(item)
        return items, i + 1
    if c == b"d":
        i, d = i + 1, {}
        while data[i:i + 1] != b"e":
            key, i = _bdecode(data, i)
            if not isinstance(key, bytes):
                raise ValueError("dictionary key is not a string")
            d[key], i = _bdecode(data, i)
        return d, i + 1
    if c.isdigit():
        colon = data.index(b":", i)
        n = int(data[i:colon])
        if n < 0 or colon + 1 + n > len(data):
            raise ValueError("string runs past the end")
        return data[colon + 1:colon + 1 + n], colon + 1 + n
    raise ValueError(f"unexpected byte {c!r} at {i}")
