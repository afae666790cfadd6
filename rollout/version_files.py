"""A verified version directory as the vLLM backend reads it (rollout/vllm_transfer.py), and
the in-place element write it patches with. No vLLM import: unit-testable in the main venv."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from chain.versiondir import BadVersionDir, read_info
from rollout.vllm_ext import checkpoint_files


@dataclass
class Target:
    """What update_weights was pointed at: digests, shapes and dtypes of every tensor."""

    version: int
    path: Path
    digests: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    files: dict[str, Path]


def read_target(path: Path, version: int) -> Target:
    """A verified version directory: its VERSION.json digests and each tensor's shape/dtype
    (from the safetensors headers; no tensor data is read)."""
    try:
        vinfo = read_info(path)
    except BadVersionDir as e:
        raise ValueError(f"{path} is not a finished deltaswarm version: {e}") from None
    if vinfo.version != version:
        raise ValueError(f"{path} holds version {vinfo.version}, not {version}")
    files = checkpoint_files(path)
    if set(files) != set(vinfo.tensors):
        extra = sorted(set(files) - set(vinfo.tensors))
        missing = sorted(set(vinfo.tensors) - set(files))
        raise ValueError(f"{path}: safetensors and VERSION.json disagree (not in VERSION.json: "
                         f"{extra[:5]}, missing from files: {missing[:5]})")
    shapes, dts = {}, {}
    for f in sorted(set(files.values())):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 (safe_open has no __iter__)
                sl = sf.get_slice(name)
                shapes[name] = tuple(sl.get_shape())
                dts[name] = _TORCH_DTYPES[sl.get_dtype()]
    return Target(version, path, dict(vinfo.tensors), shapes, dts, files)


_TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                 "F64": torch.float64, "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16,
                 "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
                 "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def scatter(flat: torch.Tensor, bits: np.ndarray, pos: np.ndarray | None,
            dtype: torch.dtype) -> int:
    """flat[pos] = the file's values at pos (all of them when pos is None); bytes moved."""
    if pos is None:
        values = torch.from_numpy(np.array(bits)).view(dtype)
        flat.copy_(values.to(device=flat.device, dtype=flat.dtype))
        return values.numel() * values.element_size()
    idx = torch.from_numpy(np.ascontiguousarray(pos, dtype=np.int64))
    values = torch.from_numpy(bits[idx.numpy()]).view(dtype)
    flat.index_copy_(0, idx.to(flat.device), values.to(device=flat.device, dtype=flat.dtype))
    return values.numel() * (values.element_size() + 8)
