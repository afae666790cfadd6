"""Manifests: the canonical, signed JSON description of one artifact (a version's delta or
snapshot).

Canonical form = JSON with sorted keys, no whitespace, ASCII only, signature field removed; the
trainer signs exactly those bytes. Everything a node trusts about a version (its parent, its
tensors, its blocks and their BitTorrent pieces roots) is in here, so a lying peer can only ever
hand out data that fails a check.
"""

import json
import re
from typing import Annotated, Any, Literal

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from chain import keys
from chain.blocktable import MAX_SIZE, BlockRow, BlockTable
from chain.dtypes import BY_NAME
from chain.errors import BadManifest, BadSignature, Unsigned
from chain.tensortable import Sized, TensorTable

FORMAT = 2
"""2: tensor digests are additive lane hashes (chain/lanehash.py); 1 used xxh3-128."""
FORMAT_SHARDED = 3
"""3: as 2, but the tensor stream is several sub-streams (`streams`: blocks in each), one per
rank of a sharded trainer, whose records may cover an element range of a tensor (`at`, `count`
in the record header). Written only by the sharded publisher; a build that reads only 2
refuses it with "format 3 is not supported ... upgrade"."""
FORMATS = (FORMAT, FORMAT_SHARDED)
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
Hex32 = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
Hex64 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
_ARTIFACT = re.compile(r"^v(\d{8})\.(delta|snapshot)$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Parent(_Strict):
    version: int = Field(ge=0)
    state_digest: Hex32


class TensorEntry(_Strict, Sized):
    name: str = Field(min_length=1, max_length=1024)
    dtype: str
    shape: list[Annotated[int, Field(ge=0)]]
    digest: Hex32

    @model_validator(mode="after")
    def _known_dtype(self) -> "TensorEntry":
        if self.dtype not in BY_NAME:
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        return self


class BlockEntry(_Strict):
    id: Hex32
    size: int = Field(gt=0, le=MAX_SIZE)
    root: Hex64


class FileEntry(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,128}$")
    block: Hex32
    size: int = Field(gt=0)


class Signature(_Strict):
    key: Hex64
    sig: str = Field(pattern=r"^[0-9a-f]{128}$")


class BasePin(_Strict):
    """What an adapter version (LoRA) is trained on: a version of another chain, pinned by its
    state digest. A region applies the adapter only over a base it holds with that digest."""

    run: str = Field(min_length=1, max_length=128)
    version: int = Field(ge=0)
    state_digest: Hex32


class Manifest(_Strict):
    format: Literal[2, 3]
    run: str = Field(min_length=1, max_length=128)
    version: int = Field(ge=0)
    kind: Literal["delta", "snapshot"]
    parent: Parent | None
    state_digest: Hex32
    tensors: TensorTable
    """Held as columns (chain/tensortable.py): reads as a list of TensorEntry."""
    blocks: BlockTable
    """Held as columns (chain/blocktable.py): reads as a list of BlockEntry."""
    files: list[FileEntry] = []
    stats: dict[str, int | float] = {}
    created: float = 0.0
    signature: Signature | None = None
    streams: list[Annotated[int, Field(gt=0)]] | None = None
    """Format 3 only: how many stream blocks each sub-stream has, in block order."""
    base: BasePin | None = None
    """Set on adapter versions (chain/adapters.py): the base model they apply to."""

    @model_validator(mode="after")
    def _consistent(self) -> "Manifest":
        if self.kind == "delta" and self.parent is None:
            raise ValueError("a delta needs a parent (version and state_digest)")
        if self.kind == "delta" and self.parent and self.parent.version != self.version - 1:
            raise ValueError(f"delta v{self.version} must have parent v{self.version - 1}")
        if self.kind == "snapshot" and self.parent is not None:
            raise ValueError("a snapshot has no parent")
        if not self.tensors.ascending():
            raise ValueError("tensors must be unique and sorted by name")
        ids = self.blocks.ids()
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate block ids")
        if any(f.block not in ids for f in self.files):
            raise ValueError("every file's block must be listed in blocks")
        if self.tensors.state_digest() != self.state_digest:
            raise ValueError("state_digest does not match the tensor digests")
        if self.format == FORMAT and self.streams is not None:
            raise ValueError("format 2 has one stream: `streams` needs format 3")
        if self.format == FORMAT_SHARDED and (
                self.streams is None or sum(self.streams) != len(self.stream_blocks)):
            raise ValueError("format 3 needs `streams` adding up to its stream blocks "
                             f"({len(self.stream_blocks)})")
        return self

    @property
    def artifact(self) -> str:
        return artifact_name(self.version, self.kind)

    @property
    def payload_bytes(self) -> int:
        return self.blocks.total()

    @property
    def stream_blocks(self) -> list[BlockRow]:
        """Blocks of the tensor stream, in order (file blocks excluded)."""
        files = {f.block for f in self.files}
        return [b for b in self.blocks if b.id not in files]

    @property
    def substreams(self) -> list[list[BlockRow]]:
        """The stream blocks cut into their sub-streams (one for format 2)."""
        blocks = self.stream_blocks
        if self.streams is None:
            return [blocks]
        out, at = [], 0
        for n in self.streams:
            out.append(blocks[at:at + n])
            at += n
        return out

    def _dump(self, exclude: set[str]) -> dict:
        # documents without `streams` or `base` never carry the key, so the bytes (and the
        # signatures) of full-model versions are as they were before either existed
        absent = {k for k in ("streams", "base") if getattr(self, k) is None}
        return self.model_dump(mode="json", exclude=exclude | absent)

    def _canonical(self, exclude: set[str]) -> bytes:
        """canonical_json(self._dump(exclude)), the tensor list written from its columns
        (TensorTable.canonical_json): a canonical object is its sorted keys' members joined,
        so the rest of the document is dumped as usual and the list is put in its place."""
        doc = self._dump(exclude | {"tensors"})
        doc["tensors"] = None
        parts = [b"{"]
        for k in sorted(doc):  # one join: the 7 MB list of 50,000 tensors copied once
            parts += [json.dumps(k).encode(), b":", self.tensors.canonical_json()
                      if k == "tensors" else canonical_json(doc[k]), b","]
        parts[-1] = b"}"
        return b"".join(parts)

    def canonical(self) -> bytes:
        return self._canonical({"signature"})

    def signed(self, key: Ed25519PrivateKey) -> "Manifest":
        sig = Signature(key=keys.public_hex(key), sig=keys.sign(key, self.canonical()))
        return self.model_copy(update={"signature": sig})

    def to_bytes(self) -> bytes:
        return self._canonical(set())

    def check_signature(self, public_key: Ed25519PublicKey) -> None:
        """What `parse` checks of a received document's signature, for a manifest built in
        this process (ChainStore.add stores it without dumping and parsing it back)."""
        if self.signature is None:
            raise Unsigned(f"manifest {self.artifact} is unsigned; refusing it")
        _check_key(self.artifact, self.signature.key, public_key)
        keys.verify(public_key, self.canonical(), self.signature.sig)

    @classmethod
    def parse(cls, raw: bytes, public_key: Ed25519PublicKey | None) -> "Manifest":
        """Validate `raw` and, when `public_key` is given, check it is signed by that key.

        The signature is checked first, over the canonical bytes of the document as received,
        and only a document the trainer signed is schema-validated: validating a forged 35 MB
        manifest took 7.5 s, checking its signature a small fraction of that (bench/manifest.py).
        Still CPU-bound on big manifests: async callers run it off the event loop.
        """
        if len(raw) > MAX_MANIFEST_BYTES:
            raise BadManifest(f"manifest of {len(raw)} bytes exceeds {MAX_MANIFEST_BYTES}")
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise BadManifest(f"manifest is not valid JSON: {str(e)[:200]}") from None
        if not isinstance(doc, dict):
            raise BadManifest("manifest must be a JSON object")
        old = doc.get("format")
        if isinstance(old, int) and not isinstance(old, bool) and 0 < old < FORMAT:
            raise BadManifest(
                f"manifest format {old} was written by an older deltaswarm whose tensor digests "
                f"this build (format {FORMAT}) does not use; re-publish the chain from the "
                "trainer's weights with this version"
            )
        if old not in FORMATS or isinstance(old, bool):
            raise BadManifest(
                f"manifest format {doc.get('format')!r:.40} is not supported (this build reads "
                f"formats {FORMAT} and {FORMAT_SHARDED}); upgrade deltaswarm on this node"
            )
        if public_key is not None:
            _check_signature(doc, public_key)
        try:
            return cls.model_validate(doc)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "manifest"
            raise BadManifest(f"manifest field {where}: {err['msg']}") from None


def _check_signature(doc: dict, public_key: Ed25519PublicKey) -> None:
    """Refuse `doc` unless its `signature` is the pinned key's over its canonical bytes; reads
    nothing else of the (unvalidated) document but `version` and `kind` for the message."""
    version, kind = doc.get("version"), doc.get("kind")
    name = (artifact_name(version, kind) if type(version) is int and 0 <= version < 10**8
            and kind in ("delta", "snapshot") else "manifest")
    sig = doc.get("signature")
    if sig is None:
        raise Unsigned(f"manifest {name} is unsigned; refusing it")
    if not (isinstance(sig, dict) and isinstance(sig.get("key"), str)
            and isinstance(sig.get("sig"), str)):
        raise BadSignature(f"manifest {name}: signature must be {{\"key\", \"sig\"}} hex strings")
    _check_key(name, sig["key"], public_key)
    try:
        signed = canonical_json({k: v for k, v in doc.items() if k != "signature"})
    except (ValueError, RecursionError):  # NaN/Infinity or nesting no trainer signs
        raise BadSignature(f"manifest {name} holds values no trainer signs (NaN, Infinity or "
                           "deep nesting); refusing it") from None
    keys.verify(public_key, signed, sig["sig"])


def _check_key(name: str, key_hex: str, public_key: Ed25519PublicKey) -> None:
    pinned = keys.public_hex(public_key)
    if key_hex != pinned:
        raise BadSignature(f"manifest {name} is signed by key {key_hex[:16]!r}…, not the "
                           f"pinned trainer key {pinned[:16]}…")


def tensor_problem(name: object, dtype: object, shape: object) -> str | None:
    """Why a tensor with this name, dtype and shape could not be listed in a manifest (None: it
    could). The check is `TensorEntry`'s own, so a publisher runs it on what it reads before
    encoding anything, instead of failing on the manifest after the whole version."""
    return _problem(TensorEntry, name=name, dtype=dtype, shape=shape, digest="0" * 32)


def file_problem(name: object, size: object) -> str | None:
    """Why a file with this name and size could not travel in a manifest (None: it could);
    `FileEntry`'s own check, run before encoding (see tensor_problem)."""
    return _problem(FileEntry, name=name, block="0" * 32, size=size)


def _problem(model: type[BaseModel], **fields: object) -> str | None:
    try:
        model(**fields)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or model.__name__
        return f"{where}: {err['msg']}"
    return None


def canonical_json(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def artifact_name(version: int, kind: str) -> str:
    return f"v{version:08d}.{kind}"


def parse_artifact(name: str) -> tuple[int, str]:
    m = _ARTIFACT.match(name)
    if not m:
        raise BadManifest(f"invalid artifact name {name!r}: expected like v00000005.delta")
    return int(m.group(1)), m.group(2)
