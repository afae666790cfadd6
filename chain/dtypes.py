"""Element types the chain can carry, and how their bit patterns are viewed.

A tensor is handled as an array of unsigned integers of the same width (its bit patterns), so
the codec never does float arithmetic and every value, NaN payloads and -0.0 included, round-trips.
"""

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import numpy as np

from chain.errors import BadManifest

if TYPE_CHECKING:  # torch is imported only when a tensor is handled: daemons start faster
    import torch


@dataclass(frozen=True)
class DType:
    """One supported element type.

    `mantissa_bits` / `exponent_bits` locate the exponent field used as coding context;
    integer types have exponent_bits == 0.
    """

    name: str
    bits: int
    mantissa_bits: int
    exponent_bits: int

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch

        return getattr(torch, self.name)

    @property
    def uint(self) -> np.dtype:
        return _UINT[self.bits]

    @property
    def itemsize(self) -> int:
        return self.bits // 8


_UINT = {bits: np.dtype(f"uint{bits}") for bits in (8, 16, 32, 64)}
"""The unsigned type of each width, made once: `uint` is read per tensor on every hot path."""
_ALL = [
    DType("bfloat16", 16, 7, 8),
    DType("float16", 16, 10, 5),
    DType("float32", 32, 23, 8),
    DType("float64", 64, 52, 11),
    DType("float8_e4m3fn", 8, 3, 4),
    DType("float8_e5m2", 8, 2, 5),
    DType("int8", 8, 0, 0),
    DType("uint8", 8, 0, 0),
    DType("int16", 16, 0, 0),
    DType("int32", 32, 0, 0),
    DType("int64", 64, 0, 0),
    DType("bool", 8, 0, 0),
]
BY_NAME: dict[str, DType] = {d.name: d for d in _ALL}


@cache
def _by_torch() -> "dict[torch.dtype, DType]":
    return {d.torch_dtype: d for d in _ALL}

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


@cache
def torch_names() -> "dict[torch.dtype, str]":
    """Our name of each supported torch dtype: for walks over many tensors (a missing key
    is an unsupported dtype, which `of_tensor` names)."""
    return {t: d.name for t, d in _by_torch().items()}


def of_tensor(t: "torch.Tensor") -> DType:
    try:
        return _by_torch()[t.dtype]
    except KeyError:
        raise BadManifest(f"unsupported tensor dtype {t.dtype}") from None


@cache
def _same_width_ints() -> dict:
    """{torch dtype: (a torch integer dtype of its width, None or the numpy unsigned type to
    view its `.numpy()` as)}: torch's own unsigned types where `.numpy()` takes them (one call
    fewer a tensor), else its signed ones (torch builds without uint16-64 numpy support)."""
    import torch

    try:
        for d in (torch.uint16, torch.uint32, torch.uint64):
            torch.zeros(1, dtype=d).numpy()
        ints = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}
        return {t: (ints[dt.itemsize], None) for t, dt in _by_torch().items()}
    except (AttributeError, TypeError, RuntimeError):
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        return {t: (ints[dt.itemsize], dt.uint) for t, dt in _by_torch().items()}


def bits_view(t: "torch.Tensor") -> np.ndarray:
    """The tensor's bit patterns as a flat numpy unsigned array (no copy for contiguous CPU).
    A contiguous CPU tensor takes a torch view, `.numpy()` and a reshape (6.3 us on a slow host,
    against 7.9 for a signed view viewed again as unsigned: paid per tensor, several times per
    publish of a 50,000-tensor model)."""
    import torch

    fast = _same_width_ints().get(t.dtype)
    if fast is not None and t.is_cpu and not t.requires_grad and t.is_contiguous():
        flat = t.view(fast[0]).numpy().reshape(-1)
        return flat if fast[1] is None else flat.view(fast[1])
    dt = of_tensor(t)
    flat = t.detach().contiguous().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.view(torch.uint8).numpy().view(dt.uint)
