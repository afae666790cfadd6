"""Ed25519 keys of the trainer: generate, load, sign, verify (via `cryptography`).

Keys travel as raw 32-byte values in hex, so a public key fits on one line of a YAML config.
"""

from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from chain.atomic import write_atomic
from chain.errors import BadSignature, ChainError

_RAW = serialization.Encoding.Raw


def generate(path: Path) -> Ed25519PrivateKey:
    key = Ed25519PrivateKey.generate()
    raw = key.private_bytes(_RAW, serialization.PrivateFormat.Raw, serialization.NoEncryption())
    write_atomic(Path(path), raw.hex().encode() + b"\n")
    Path(path).chmod(0o600)
    return key


def load_private(path: Path) -> Ed25519PrivateKey:
    try:
        return Ed25519PrivateKey.from_private_bytes(bytes.fromhex(Path(path).read_text().strip()))
    except (ValueError, OSError) as e:
        raise ChainError(f"cannot load the trainer signing key {path}: {e}") from None


def public_hex(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(_RAW, serialization.PublicFormat.Raw).hex()


def parse_public(hex_key: str) -> Ed25519PublicKey:
    try:
        raw = bytes.fromhex(hex_key.strip())
        if len(raw) != 32:
            raise ValueError(f"{len(raw)} bytes, expected 32")
        return Ed25519PublicKey.from_public_bytes(raw)
    except ValueError as e:
        raise ChainError(f"invalid Ed25519 public key {hex_key!r}: {e}") from None


def sign(key: Ed25519PrivateKey, message: bytes) -> str:
    return key.sign(message).hex()


def verify(pub: Ed25519PublicKey, message: bytes, signature_hex: str) -> None:
    try:
        pub.verify(bytes.fromhex(signature_hex), message)
    except (InvalidSignature, ValueError):
        raise BadSignature(
            "manifest signature does not verify against the pinned trainer key "
            f"{public_hex(pub)[:16]}…: forged, altered, or signed by another trainer"
        ) from None
