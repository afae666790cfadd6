"""Errors for bad input from peers, files and users.

Every message names the thing that is wrong and, where there is one, what to do about it.
Callers catch `ChainError` to refuse an input without touching stored state.
"""


class ChainError(Exception):
    """Base class: an input (file, block, manifest, delta) was refused."""


class BadBlock(ChainError):
    """A block's bytes do not match its id, or it is missing or too large."""


class BadManifest(ChainError):
    """A manifest is malformed, inconsistent, or fails validation."""


class BadSignature(BadManifest):
    """A manifest is unsigned, or signed by a key other than the pinned trainer key."""


class Unsigned(BadSignature):
    """A manifest carries no signature at all."""


class OtherRun(BadManifest):
    """A manifest belongs to another training run than the chain it was offered to."""


class Replay(BadManifest):
    """A manifest conflicts with one already held for the same artifact (fork or replay)."""


class WrongParent(BadManifest):
    """A delta names a parent state digest other than the held parent version's."""


class BadDelta(ChainError):
    """A delta stream or payload is truncated, corrupted, or does not fit its base."""


class DigestMismatch(ChainError):
    """Reconstructed weights do not have the digest the manifest promises."""


class NoPath(ChainError):
    """No combination of held versions, snapshots and deltas reaches the requested version."""
