"""Where each element of a checkpoint tensor lives in a running model, learned from the model's
own loader: the map an in-place patch writes through (rollout/vllm_patch.py).

vLLM's `model.load_weights` already knows every layout rule (q/k/v rows at their offsets in
`qkv_proj`, gate/up in `gate_up_proj`, this tensor-parallel rank's rows or columns, padded
vocabulary rows): each checkpoint tensor ends in one or more `param_slice.copy_(ckpt_slice)`.
`probe` runs the loader once per tensor on an untouched stand-in (torch.empty: virtual memory,
never read) with `Tensor.copy_` intercepted, so nothing is written; each intercepted copy is a
box: a block of the checkpoint tensor and the block of a live parameter it lands in. Positions
outside every box are not held by this rank (another rank's shard) and are dropped.

The contract is the one vLLM's own checkpoint-weight-patch API states: the loader ends in a
same-shaped `copy_` of narrowed views. A loader that copies nothing, transforms the tensor, or
writes a parameter vLLM repacked or quantized (empty, or of another dtype class) gives no map
(None): that tensor needs the module reload.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Box:
    """ckpt[src_lo + i] lands in param[dst_lo + i] for 0 <= i < extent (multi-indices)."""

    param: str
    src_lo: tuple[int, ...]
    dst_lo: tuple[int, ...]
    extent: tuple[int, ...]


def _lo(view: torch.Tensor, base: torch.Tensor) -> tuple[int, ...] | None:
    """The multi-index in contiguous `base` where `view` (a narrowed block of it) starts, or
    None if `view` is not such a block (other strides, another storage)."""
    if not base.is_contiguous() or view.untyped_storage().data_ptr() != \
            base.untyped_storage().data_ptr():
        return None
    if view.dim() != base.dim() or any(v != b for v, b, n in
                                       zip(view.stride(), base.stride(), view.shape, strict=True)
                                       if n > 1):
        return None
    off = view.storage_offset() - base.storage_offset()
    if off < 0 or base.numel() == 0:
        return None
    lo = tuple(int(x) for x in np.unravel_index(off, tuple(base.shape))) if base.dim() else ()
    if any(a + n > b for a, n, b in zip(lo, view.shape, base.shape, strict=True)):
        return None
    return lo


def probe(model: torch.nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
          load: Callable[[list[tuple[str, torch.Tensor]]], object] | None = None,
          ) -> list[Box] | None:
    """The boxes checkpoint tensor `name` is loaded through, or None (see the module doc).
    `load` defaults to model.load_weights."""
    params = {p.data.untyped_storage().data_ptr(): (n, p.data)
              for n, p in model.named_parameters() if p.numel() and not p.is_meta}
    stand_in = torch.empty(shape, dtype=dtype)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    foreign: list[str] = []
    original = torch.Tensor.copy_

    def record(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if src.untyped_storage().data_ptr() == stand_in.untyped_storage().data_ptr():
            seen.append((dst, src))
        else:
            foreign.append(f"{tuple(dst.shape)}")
        return dst

    torch.Tensor.copy_ = record  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            (load or model.load_weights)([(name, stand_in)])  # type: ignore[operator]
    except Exception:
        return None
    finally:
        torch.Tensor.copy_ = original  # type: ignore[method-assign]
    if not seen or foreign:
        return None
    boxes = []
    for dst, src in seen:
        if dst.shape != src.shape or dst.is_floating_point() != dtype.is_floating_point:
            return None
        owner = params.get(dst.untyped_storage().data_ptr())
        if owner is None:
            return None
        pname, pdata = owner
        dst_lo, src_lo = _lo(dst, pdata), _lo(src, stand_in)
        if dst_lo is None or src_lo is None:
            return None
        boxes.append(Box(pname, src_lo, dst_lo, tuple(int(n) for n in dst.shape)))
    return boxes


def to_live(positions: np.ndarray, shape: tuple[int, ...], boxes: Iterable[Box],
            param_shapes: Mapping[str, tuple[int, ...]]
            ) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Per box: (param, which of `positions` it holds, their flat positions in the param).
    Positions no box holds are another rank's (dropped)."""
    positions = np.asarray(positions, np.int64)
    if not shape:
        idx = [np.zeros(positions.size, np.int64)]
        shape = (1,)
    else:
        idx = list(np.unravel_index(positions, shape))
    out = []
    for b in boxes:
        keep = np.ones(positions.size, bool)
        for k in range(len(shape)):
            keep &= (idx[k] >= b.src_lo[k]) & (idx[k] < b.src_lo[k] + b.extent[k])
        sel = np.flatnonzero(keep)
        pshape = tuple(param_shapes[b.param]) or (1,)
        live = np.ravel_multi_index(
            tuple(idx[k][sel] - b.src_lo[k] + b.dst_lo[k] for k in range(len(shape))), pshape)
        out.append((b.param, sel, live.astype(np.int64)))
    return out
