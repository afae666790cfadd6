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
from chain.versiondir import BadVersionDir, read_info

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
VERSION_WEIGHTS = "model.safetensors"
"""What a reconstructed version directory names its (single-shard) tensor file."""


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
    if str(doc.get("peft_type", "LORA")).upper() != "LORA":
        raise BadAdapter(f"{ADAPTER_CONFIG} has peft_type {doc.get('peft_type')!r}; only LORA "
                         "adapters are carried")
    rank, alpha = doc.get("r"), doc.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1:
        raise BadAdapter(f"{ADAPTER_CONFIG} needs a positive integer rank `r`, has {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise BadAdapter(f"{ADAPTER_CONFIG} needs a number `lora_alpha`, has {alpha!r}")
    return doc


def pin_for(manifest: Manifest) -> BasePin:
    """The pin naming the version `manifest` describes (the base's delta or snapshot)."""
    return BasePin(run=manifest.run, version=manifest.version,
                   state_digest=manifest.state_digest)


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
    """The directory holding exactly `pin`'s weights, or BaseNotHeld saying what is held."""
    if weights_root is None:
        raise BaseNotHeld(
            f"{artifact} is a LoRA adapter over base {pin.run} v{pin.version} "
            f"(digest {pin.state_digest[:12]}…), and this daemon has no adapter.base_weights: "
            "set it to the weights directory of the daemon that follows the base chain")
    held = held_bases(weights_root)
    for have, path in held:
        if have.state_digest == pin.state_digest:
            return path
    holding = ", ".join(f"{h.run} v{h.version} ({h.state_digest[:12]}…)" for h, _ in held[:4])
    raise BaseNotHeld(
        f"{artifact} is a LoRA adapter over base {pin.run} v{pin.version} (digest "
        f"{pin.state_digest[:12]}…), which this region does not hold; {weights_root} holds "
        f"{holding or 'no finished version'}. The adapter is not applied until the base daemon "
        "holds that version (or the run is retrained on a base this region has)")


def write_peft_dir(version_dir: Path, dest: Path) -> Path:
    """A PEFT adapter directory `dest` (what vLLM's load_lora_adapter and PEFT read) copied from
    a reconstructed adapter version. A copy, not a link: version directories are rewritten in
    place when the chain moves on, and the engine may read `dest` later. Written under a
    temporary name and renamed, so `dest` is complete or absent."""
    src = Path(version_dir)
    if not (src / ADAPTER_CONFIG).is_file() or not (src / VERSION_WEIGHTS).is_file():
        raise BadAdapter(f"{src} is not an adapter version (needs {ADAPTER_CONFIG} and "
                         f"{VERSION_WEIGHTS})")
    check_config((src / ADAPTER_CONFIG).read_bytes())
    dest = Path(dest)
    tmp = dest.with_name(f".tmp-{dest.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copyfile(src / VERSION_WEIGHTS, tmp / ADAPTER_WEIGHTS)
    shutil.copyfile(src / ADAPTER_CONFIG, tmp / ADAPTER_CONFIG)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    fsync_dir(dest.parent)
    return dest
