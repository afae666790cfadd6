"""Proof that an inference engine's live weights are a version's: read each checkpoint tensor
back out of the model as it is now, digest it, and compare with the version's VERSION.json.

The digests are the chain's own (chain/lanehash.py via chain.digest.tensor_digest), so the
expected values cost nothing: the daemon wrote them when it verified the version. Reading back
runs inside the engine's worker, on what the forward pass actually uses, after vLLM's
post-load processing; it catches a load that silently missed or garbled a tensor, a fused group
split wrongly, or weights changed behind our back (vLLM #32718, SkyRL #1680, miles #405).

A checkpoint tensor is found in the runtime model either under its own name, or as a row block
of a fused parameter (vLLM packs q/k/v into qkv_proj and gate/up into gate_up_proj along the
output dimension; `packed_modules_mapping` says which). What cannot be read back is reported as
unreadable, never counted as checked: parameters repacked into kernel layout (vLLM's CPU
backend empties them), tensor-parallel shards (the engine marks every tensor unreadable when
tensor parallelism is on), quantized or renamed weights.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from chain import dtypes
from chain.digest import tensor_digest


@dataclass(frozen=True)
class Location:
    """Where a checkpoint tensor lives at run time: rows [start, start + rows) of `param`."""

    param: str
    start: int
    rows: int
    whole: bool


def locate(name: str, shapes: Mapping[str, tuple[int, ...]],
           runtime: Mapping[str, tuple[int, ...]],
           packed: Mapping[str, list[str]]) -> Location | None:
    """The runtime parameter (and row block) holding checkpoint tensor `name`, or None.

    `shapes`: every checkpoint tensor's shape (the fused siblings' shapes give the offsets);
    `runtime`: the model's parameter shapes; `packed`: vLLM's packed_modules_mapping
    ({"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}).
    """
    shape = tuple(shapes[name])
    if name in runtime:
        have = tuple(runtime[name])
        if have == shape:
            return Location(name, 0, shape[0] if shape else 0, True)
        # vLLM pads an embedding's vocabulary rows (to a multiple of 64): the checkpoint's rows
        # come first. Anything else of another shape (a TP shard, a repacked weight) is not ours.
        if shape and len(have) == len(shape) and have[1:] == shape[1:] and have[0] > shape[0]:
            return Location(name, 0, shape[0], False)
        return None
    module, _, param = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    for fused, parts in packed.items():
        if leaf not in parts:
            continue
        target = f"{parent}.{fused}.{param}" if parent else f"{fused}.{param}"
        siblings = [f"{parent}.{p}.{param}" if parent else f"{p}.{param}" for p in parts]
        if target not in runtime or any(s not in shapes for s in siblings):
            return None
        tail = {tuple(shapes[s][1:]) for s in siblings}
        full = tuple(runtime[target])
        rows = [shapes[s][0] for s in siblings]
        if len(tail) != 1 or not shape or full != (sum(rows), *shape[1:]):
            return None
        start = sum(rows[: parts.index(leaf)])
        return Location(target, start, shape[0], False)
    return None


def live_tensor(params: Mapping[str, torch.Tensor], loc: Location, dtype: torch.dtype,
                shape: tuple[int, ...]) -> torch.Tensor:
    """The live values at `loc`, on the CPU, in the checkpoint's dtype and shape."""
    p = params[loc.param].detach()
    block = p if loc.whole else p.narrow(0, loc.start, loc.rows)
    return block.to(device="cpu", dtype=dtype).reshape(shape).contiguous()


def digest_of(t: torch.Tensor) -> str:
    return tensor_digest(dtypes.of_tensor(t).name, list(t.shape), dtypes.bits_view(t))


@dataclass
class CheckResult:
    """What a read-back found for one version on one worker."""

    version: int
    ok: bool | None
    """False: a tensor differs; None: nothing could be read back (unverified)."""
    checked: int = 0
    checked_bytes: int = 0
    mismatched: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    seconds: float = 0.0
    live: dict[str, str | None] = field(default_factory=dict)
    """name -> the live digest (None: unreadable); not in `summary()`."""

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("live")
        out["mismatched"] = self.mismatched[:20]
        out["unreadable"] = self.unreadable[:20]
        out["mismatched_count"] = len(self.mismatched)
        out["unreadable_count"] = len(self.unreadable)
        return out


def live_digests(model: torch.nn.Module, shapes: Mapping[str, tuple[int, ...]],
                 dtype_of: Mapping[str, torch.dtype], names: list[str] | None = None,
                 ) -> dict[str, str | None]:
    """Digest of each checkpoint tensor as the model holds it now (None where unreadable)."""
    params = dict(model.named_parameters())
    runtime = {n: tuple(p.shape) for n, p in params.items()}
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    out: dict[str, str | None] = {}
    for name in sorted(names if names is not None else shapes):
        loc = locate(name, shapes, runtime, packed)
        if loc is None or params[loc.param].is_meta or params[loc.param].numel() == 0:
            out[name] = None
            continue
        out[name] = digest_of(live_tensor(params, loc, dtype_of[name], tuple(shapes[name])))
    return out


def check(model: torch.nn.Module, version: int, expected: Mapping[str, str],
          shapes: Mapping[str, tuple[int, ...]], dtype_of: Mapping[str, torch.dtype]
          ) -> CheckResult:
    """Compare every readable checkpoint tensor with `expected` (VERSION.json's digests).
    ok: False if any differs, None if none could be read, else True."""
    t0 = time.perf_counter()
    live = live_digests(model, shapes, dtype_of, sorted(expected))
    res = CheckResult(version=version, ok=False, live=live)
    for name in sorted(expected):
        got = live.get(name)
        if got is None:
            res.unreadable.append(name)
        elif got != expected[name]:
            res.mismatched.append(name)
        else:
            res.checked += 1
            res.checked_bytes += _nbytes(shapes[name], dtype_of[name])
    res.ok = False if res.mismatched else (True if res.checked else None)
    res.seconds = time.perf_counter() - t0
    return res


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()
