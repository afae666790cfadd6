"""Lossless sparse tensor delta codec: which elements changed and by how much, coded near the
entropy of (tensor segment, old exponent) contexts. See chain/codec/kernels.py for the model;
DIRECT is how positions are coded by default (ranks within contexts, or directly).
"""

from chain.codec.api import (
    DIRECT,
    Changes,
    Layers,
    Pieces,
    apply_many,
    apply_tensor_delta,
    decode_many,
    encode_changes,
    encode_many,
    encode_tensor_delta,
    own_positions,
    payload_stats,
    split_changes,
    split_positions,
    start_decode,
)

__all__ = ["DIRECT", "Changes", "Layers", "Pieces", "apply_many", "apply_tensor_delta",
           "decode_many", "encode_changes", "encode_many", "encode_tensor_delta", "own_positions",
           "payload_stats", "split_changes", "split_positions", "start_decode"]
