"""Element types the chain can carry, and how their bit patterns are viewed.

A tensor is handled as an array of unsigned integers of the same width (its bit patterns), so
the codec never does float arithmetic and every value, NaN payloads and -0.0 included, round-trips.
"""

from dataclasses import dataclass

import numpy as np
import torch

from chain.errors import BadManifest


@dataclass(frozen=True)
class DType:
    """One supported element type.

    `mantissa_bits` / `exponent_bits` locate the exponent field used as coding context;
    integer types have exponent_bits == 0.
    """

    name: str
    torch_dtype: torch.dtype
    bits: int
    mantissa_bits: int
    exponent_bits: int

    @property
    def uint(self) -> np.dtype:
        return np.dtype(f"uint{self.bits}")

    @property
    def itemsize(self) -> int:
        return self.bits // 8


_ALL = [
    DType("bfloat16", torch.bfloat16, 16, 7, 8),
    DType("float16", torch.float16, 16, 10, 5),
    DType("float32", torch.float32, 32, 23, 8),
    DType("float64", torch.float64, 64, 52, 11),
    DType("float8_e4m3fn", torch.float8_e4m3fn, 8, 3, 4),
    DType("float8_e5m2", torch.float8_e5m2, 8, 2, 5),
    DType("int8", torch.int8, 8, 0, 0),
    DType("uint8", torch.uint8, 8, 0, 0),
    DType("int16", torch.int16, 16, 0, 0),
    DType("int32", torch.int32, 32, 0, 0),
    DType("int64", torch.int64, 64, 0, 0),
    DType("bool", torch.bool, 8, 0, 0),
]
BY_NAME: dict[str, DType] = {d.name: d for d in _ALL}
BY_TORCH: dict[torch.dtype, DType] = {d.torch_dtype: d for d in _ALL}

# safetensors' names for the same types
SAFETENSORS_NAME = {
    "bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "int8": "I8", "uint8": "U8",
    "int16": "I16", "int32": "I32", "int64": "I64", "bool": "BOOL",
}
FROM_SAFETENSORS = {v: k for k, v in SAFETENSORS_NAME.items()}


def lookup(name: str) -> DType:
    """The DType called `name`, or a BadManifest naming the supported ones."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise BadManifest(
            f"unsupported dtype {name!r}; supported: {', '.join(sorted(BY_NAME))}"
        ) from None


def of_tensor(t: torch.Tensor) -> DType:
    try:
        return BY_TORCH[t.dtype]
    except KeyError:
        raise BadManifest(f"unsupported tensor dtype {t.dtype}") from None


def bits_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's bit patterns as a flat numpy unsigned array (no copy for contiguous CPU)."""
    dt = of_tensor(t)
    flat = t.detach().contiguous().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.view(torch.uint8).numpy().view(dt.uint)


def tensor_from_bits(bits: np.ndarray, dtype: str, shape: list[int]) -> torch.Tensor:
    """Inverse of bits_view: a torch tensor sharing memory with `bits`."""
    dt = lookup(dtype)
    raw = torch.from_numpy(np.ascontiguousarray(bits).view(np.uint8))
    return raw.view(dt.torch_dtype).reshape(shape)
