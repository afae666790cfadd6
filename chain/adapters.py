"""LoRA adapter versions: a run's adapters as a chain of their own, pinned to a base version.

A LoRA run trains a few small matrices beside a frozen base. Its chain carries only the adapter
(PEFT layout: the `adapter_model.safetensors` tensors as the version's tensors, and
`adapter_config.json` as a carried file), and every manifest names its base (`Manifest.base`:
the base chain's run, version and state digest, signed with the rest). The base itself is an
ordinary version of another chain, published once. A region applies an adapter version only
when it holds that exact base (`find_base`), so an adapter trained on one base is never served
over another; it then hands the engine a PEFT directory (`write_peft_dir`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from chain.atomic import fsync_dir
from chain.errors import ChainError
from chain.manifest import BasePin, Manifest
from chain.sources import FileSource, source_digest
from chain.store import ChainStore
from chain.versiondir import BadVersionDir, read_info

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
VERSION_WEIGHTS = "model.safetensors"
"""What a reconstructed version directory names its (single-shard) tensor file."""


PLAIN_LORA: dict[str, tuple] = {
    "rank_pattern": (None, {}), "alpha_pattern": (None, {}), "use_dora": (None, False),
    "bias": (None, "none"), "fan_in_fan_out": (None, False), "modules_to_save": (None, [], ()),
}
"""PEFT features a region's engines would apply differently or not at all: refused by name."""


class BaseNotHeld(ChainError):
    """An adapter version's base is not a version this region holds."""


class BadAdapter(ChainError):
    """A directory or config that is not a usable PEFT LoRA adapter."""


def is_adapter_dir(path: Path) -> bool:
    """A PEFT adapter checkpoint: adapter_config.json beside adapter_model.safetensors."""
    return (Path(path) / ADAPTER_CONFIG).is_file() and (Path(path) / ADAPTER_WEIGHTS).is_file()


def check_config(raw: bytes) -> dict:
    """adapter_config.json as a dict, or BadAdapter naming what is wrong with it."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadAdapter(f"{ADAPTER_CONFIG} is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise BadAdapter(f"{ADAPTER_CONFIG} must be a JSON object")
    return check_doc(doc)


def check_doc(doc: dict) -> dict:
    """An adapter config (parsed, or PEFT's LoraConfig.to_dict()) if it is plain LoRA."""
    kind = doc.get("peft_type", "LORA")
    kind = getattr(kind, "value", kind)  # PEFT's PeftType enum in a to_dict()
    if str(kind).upper() != "LORA":
        raise BadAdapter(f"{ADAPTER_CONFIG} has peft_type {kind!r}; only LORA adapters are "
                         "carried")
    rank, alpha = doc.get("r"), doc.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise BadAdapter(f"{ADAPTER_CONFIG} needs a positive integer rank `r`, has {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise BadAdapter(f"{ADAPTER_CONFIG} needs a number `lora_alpha`, has {alpha!r}")
    for field, plain in PLAIN_LORA.items():
        if doc.get(field) not in plain:
            raise BadAdapter(f"{ADAPTER_CONFIG} sets {field}={doc[field]!r}; only plain LoRA "
                             "(one rank and alpha, no DoRA, no bias or extra trained modules, "
                             "Linear weights) is carried, so every engine applies it alike")
    return doc


def pin_for(manifest: Manifest) -> BasePin:
    """The pin naming the version `manifest` describes (the base's delta or snapshot)."""
    return BasePin(run=manifest.run, version=manifest.version,
                   state_digest=manifest.state_digest)


def head_pin(store: ChainStore) -> BasePin | None:
    """The pin of a chain's head version (None: nothing published yet)."""
    head = store.head()
    if head is None:
        return None
    return pin_for(store.get(head, "snapshot") or store.get(head, "delta"))


def pin_of(version_dir: Path) -> BasePin:
    """The pin naming a reconstructed (or published) base version directory."""
    try:
        info = read_info(Path(version_dir))
    except BadVersionDir as e:
        raise BaseNotHeld(f"{version_dir} is not a finished base version: {e}") from None
    return BasePin(run=info.run, version=info.version, state_digest=info.state_digest)


def held_bases(weights_root: Path) -> list[tuple[BasePin, Path]]:
    """Every finished version under a base daemon's weights directory, newest first."""
    found = []
    for path in sorted(Path(weights_root).glob("v[0-9]*"), reverse=True):
        try:
            found.append((pin_of(path), path))
        except BaseNotHeld:
            continue  # staging or damaged: not a base anyone can serve from
    return found


def find_base(weights_root: Path | None, pin: BasePin, artifact: str) -> Path:
    """The base daemon's current directory if it holds exactly `pin`'s weights, or BaseNotHeld
    saying what is held. Current, not any version it keeps: the engine serves the base the
    base daemon made current, so an adapter pinned to an older one would run over another."""
    if weights_root is None:
        raise BaseNotHeld(
            f"{artifact} is a LoRA adapter over base {pin.run} v{pin.version} "
            f"(digest {pin.state_digest[:12]}…), and this daemon has no adapter.base_weights: "
            "set it to the weights directory of the daemon that follows the base chain")
    current = Path(weights_root) / "current"
    try:
        have = pin_of(current.resolve()) if current.exists() else None
    except BaseNotHeld:
        have = None
    if have is not None and have.state_digest == pin.state_digest:
        return current.resolve()
    older = any(h.state_digest == pin.state_digest for h, _ in held_bases(weights_root))
    holding = (f"{have.run} v{have.version} ({have.state_digest[:12]}…)" if have
               else "no finished version")
    raise BaseNotHeld(
        f"{artifact} is a LoRA adapter over base {pin.run} v{pin.version} (digest "
        f"{pin.state_digest[:12]}…), which this region does not hold; {weights_root} holds "
        f"{holding} as current{' (the pinned one is an older version it keeps)' if older else ''}"
        ". The adapter is not applied until the base daemon's current version is that one (or "
        "the run is retrained on the base this region serves)")


def peft_dir_digest(path: Path) -> str | None:
    """State digest of a PEFT directory's adapter tensors (None: missing or unreadable)."""
    try:
        src = FileSource(Path(path), only=(ADAPTER_WEIGHTS,))
    except (OSError, ChainError):
        return None
    try:
        return source_digest(src)
    except (OSError, ChainError):
        return None
    finally:
        src.close()


def write_peft_dir(version_dir: Path, dest: Path, state_digest: str) -> Path:
    """A PEFT adapter directory `dest` (what vLLM's load_lora_adapter and PEFT read) holding the
    adapter version whose state digest is `state_digest`, copied from its reconstructed
    directory. A copy, not a link: version directories are rewritten in place when the chain
    moves on. The copy is checked against the digest (a directory rewritten meanwhile is
    refused, not loaded) and renamed into place, so `dest` is complete or absent; a `dest`
    that already holds this version is kept as it is, never rewritten: an engine may be
    serving it, and vLLM re-reads an in-place adapter's files."""
    src, dest = Path(version_dir), Path(dest)
    if (dest / ADAPTER_CONFIG).is_file() and peft_dir_digest(dest) == state_digest:
        return dest
    if not (src / ADAPTER_CONFIG).is_file() or not (src / VERSION_WEIGHTS).is_file():
        raise BadAdapter(f"{src} is not an adapter version (needs {ADAPTER_CONFIG} and "
                         f"{VERSION_WEIGHTS})")
    check_config((src / ADAPTER_CONFIG).read_bytes())
    tmp = dest.with_name(f".tmp-{dest.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        shutil.copyfile(src / VERSION_WEIGHTS, tmp / ADAPTER_WEIGHTS)
        shutil.copyfile(src / ADAPTER_CONFIG, tmp / ADAPTER_CONFIG)
        if (got := peft_dir_digest(tmp)) != state_digest:
            raise BadAdapter(f"{src} no longer holds the adapter version with digest "
                             f"{state_digest[:12]}… (its copy has {str(got)[:12]}…): it was "
                             "rewritten for a later version; load that one instead")
        shutil.rmtree(dest, ignore_errors=True)  # a damaged or foreign copy, never served
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(dest.parent)
    return dest
