"""The on-disk format of deltaswarm: sparse tensor deltas, content-addressed blocks, signed
manifests, the version chain and bit-exact reconstruction.

Pure and synchronous on purpose: no network, no event loop, and no import of the other
packages, so every node (trainer, daemon, tools) reads and writes the same bytes the same way.
"""
