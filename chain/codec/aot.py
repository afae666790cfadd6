"""The codec and digest kernels compiled ahead of time, at install, so no region applying its
first delta, publisher encoding its first version or engine patching its first version waits
on numba's JIT (even a warm JIT cache cost an engine 0.16 s loading put_wide at its first patch).

`make install` runs `python -m chain.codec.build_aot`: numba's AOT compiler (`numba.pycc`)
builds the same kernel functions (chain/codec/kernels.py, chain/lanehash.py) into extension
modules next to this file (`_aot_u1` .. `_aot_u8`, one per element width), for this machine's
CPU as the JIT would, with the GIL released while a kernel runs as `nogil=True` does. A stamp
(`_aot.json`) records what they were built from: the kernels' sources, numba's version, the
Python ABI and the CPU. `bind(jit, name)` returns a callable that runs the compiled variant when
the stamp matches and the call's argument types match a variant exactly (1-d C-contiguous arrays
of the listed dtypes, ints, bools); otherwise it runs `jit`, the njit kernel, which compiles on
first use as before. So a machine without a C compiler, a numba without pycc, a kernel edited
since the build or a moved venv all fall back to the JIT, never to stale or foreign machine code
(the compiled wrappers do not check types themselves: a wrong dtype would crash, hence the
exact match). Without them a fresh region's first delta waited 15-58 s for the JIT.
`DELTASWARM_AOT=0` runs the JIT kernels instead, e.g. under NUMBA_BOUNDSCHECK=1 (the compiled
ones check no bounds; tests/unit/chain/test_codec_boundscheck.py).
"""

import hashlib
import importlib
import json
import logging
import os
import sysconfig
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

log = logging.getLogger("deltaswarm.aot")
HERE = Path(__file__).resolve().parent
MODULE = "_aot"
STAMP = HERE / f"{MODULE}.json"
"""Written last by a build: the modules it made and what they were built from."""
SOURCES = (HERE / "kernels.py", HERE / "rangecoder.py", HERE.parent / "lanehash.py",
           HERE.parent / "lanemix.py", HERE / "build_aot.py", HERE / "aot.py")
"""What the compiled code depends on: any edit makes the module stale (the JIT runs instead).
This file too: its SPEC says what each module exports, and a module built before a kernel
joined SPEC lacks it."""

ELEMS = ("u1", "u2", "u4", "u8")
"""Element widths: every dtype the chain carries is handled as one of these (chain/dtypes.py)."""

# Argument kinds: "W" an array of the variant's element type, another numba dtype code an array
# of that type, "i" an integer (int64), "b" a bool.
_I8 = ["i8"] * 5
SPEC: dict[str, tuple[str, list[str]]] = {
    "encode_segment": ("chain.codec.kernels", [
        "W", "W", "i", "i", "b", "i", "i", "i", "i", "b", "i4", "i8", *_I8[:3], *_I8,
        "u1", "u1", "u1", "u1", "i8", "i"]),
    "encode_pieces": ("chain.codec.kernels", [
        "W", "i8", "i8", "i", "i", "i", "i", "i", "i", "b", "i4", "i8", *_I8[:3], *_I8,
        "u1", "u1", "u1", "u1", "i8", "i", "W", "u8"]),
    "decode_segment": ("chain.codec.kernels", [
        "W", "i", "i", "b", "u1", "i", "i", "i", "i", "i", "i", "i", "i", "i", "i", "b", "i4",
        *_I8, "i8", "i8", "i4", "W", "i", "i", "b"]),
    "scatter": ("chain.codec.kernels", ["W", "i", "i4", "W", "i", "i"]),
    "scatter_from": ("chain.codec.kernels", ["W", "i8", "W", "i", "i", "i"]),
    "merge_sorted": ("chain.codec.kernels", ["i8", "W", "i8", "W", "i8", "W"]),
    "diff_pairs": ("chain.lanehash", ["W", "u8", "W", "u8", "i8", "i", "i"]),
    "pull_put": ("chain.lanehash", ["W", "u8", "W", "i8", "i8", "W", "i", "i"]),
    "put": ("chain.lanehash", ["W", "u8", "i8", "W", "i", "i"]),
    "put_at": ("chain.lanehash", ["W", "u8", "i8", "W", "i", "i", "i"]),
    "put_unwritten": ("chain.lanehash", ["W", "u8", "i8", "W", "i", "i"]),
    "pull": ("chain.lanehash", ["W", "u8", "W", "i8", "i", "i"]),
    "gather": ("chain.lanehash", ["W", "i8", "W"]),
    "moved_words": ("chain.lanehash", ["u8", "u8", "i", "i8", "i", "i", "i"]),
    "moved_in_groups": ("chain.lanehash", ["W", "i8", "W", "i8", "i", "i", "u8"]),
    "pull_put_groups": ("chain.lanehash", ["W", "W", "i8", "i8", "i8", "W", "i", "i", "u8"]),
    "moved_in_word_groups": ("chain.lanehash", ["u8", "i8", "W", "i8", "i8", "i", "i", "u8"]),
    "pull_put_word_groups": ("chain.lanehash", ["W", "u8", "W", "i8", "i8", "i8", "i8", "i8", "W",
                                                "i", "u8"]),
    "sum_words": ("chain.lanehash", ["u8", "i"]),
    "put_wide": ("chain.lanehash", ["u4", "u8", "i8", "u2", "i", "i", "i"]),
    "sum_at": ("chain.lanehash", ["i8", "u8"]),
}
_DT = {"u1": np.uint8, "u2": np.uint16, "u4": np.uint32, "u8": np.uint64, "i4": np.int32,
       "i8": np.int64}


def _variants(name: str, widths: tuple[str, ...] = ELEMS) -> list[tuple[str, str, list[str]]]:
    """(module, exported name, argument kinds with W resolved) of one kernel's variants; a
    kernel without element arrays lives in the last width's module."""
    kinds = SPEC[name][1]
    if "W" not in kinds:
        return [(f"{MODULE}_{ELEMS[-1]}", name, kinds)] if ELEMS[-1] in widths else []
    return [(f"{MODULE}_{w}", name, [w if k == "W" else k for k in kinds]) for w in widths]


def _numba_sig(kinds: list[str]) -> str:
    return "(" + ", ".join({"i": "i8", "b": "b1"}.get(k, f"{k}[::1]") for k in kinds) + ")"


def _key(kinds: list[str]) -> tuple:
    return tuple(k if k in ("i", "b") else np.dtype(_DT[k]) for k in kinds)


def _arg_key(args: tuple) -> tuple | None:
    """The variant key of a call's arguments (None: no compiled variant takes them). Paid on
    every kernel call, so once or more per tensor: exact types are tested first, and an
    array's key is its dtype object (`dtype.str` alone cost ~0.6 us an array, 22 us for the
    25 arguments of encode_segment where this costs 8)."""
    key = []
    for a in args:
        t = type(a)
        if t is np.ndarray or (t is not bool and t is not int and isinstance(a, np.ndarray)):
            if a.ndim != 1 or not a.flags.c_contiguous:
                return None
            key.append(a.dtype)
        elif t is bool or t is np.bool_:
            key.append("b")
        elif t is int or isinstance(a, np.integer):
            key.append("i")
        else:
            return None
    return tuple(key)


def fingerprint() -> dict:
    """What a built module must match to be used: sources, numba, Python ABI, CPU."""
    import llvmlite.binding as ll
    import numba

    h = hashlib.sha256()
    for p in SOURCES:
        h.update(p.read_bytes())
    return {"sources": h.hexdigest()[:32], "numba": numba.__version__,
            "abi": sysconfig.get_config_var("EXT_SUFFIX"), "cpu": ll.get_host_cpu_name(),
            "features": hashlib.sha256(ll.get_host_cpu_features().flatten().encode())
            .hexdigest()[:16]}


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.loaded = False
        self.modules: dict[str, object] = {}
        self.reason = "not loaded yet"
        self.fallbacks: dict[str, int] = {}


_state = _State()


def _load() -> dict[str, object]:
    """The compiled modules by name ({} when they are absent, stale or unusable)."""
    with _state.lock:
        if _state.loaded:
            return _state.modules
        _state.loaded = True
        if os.environ.get("DELTASWARM_AOT") == "0":  # the JIT's own checks (NUMBA_BOUNDSCHECK)
            _state.reason = "compiled kernels turned off (DELTASWARM_AOT=0)"
            log.info("codec kernels: JIT (%s)", _state.reason)
            return _state.modules
        try:
            stamp = json.loads(STAMP.read_text()) if STAMP.is_file() else None
            now = fingerprint()
            if stamp is None:
                _state.reason = (f"no compiled kernels ({STAMP.name} missing): run "
                                 "`python -m chain.codec.build_aot` (make install does)")
            elif stamp.get("built") != now:
                diff = sorted(k for k in now if (stamp.get("built") or {}).get(k) != now[k])
                _state.reason = (f"compiled kernels are stale ({', '.join(diff)} changed "
                                 "since the build): rebuild them with `make aot`")
            else:
                _state.modules = {m: importlib.import_module(f"chain.codec.{m}")
                                  for m in stamp["modules"]}
                _state.reason = "compiled at install"
        except (ImportError, OSError, ValueError, KeyError, TypeError) as e:
            _state.modules = {}
            _state.reason = f"compiled kernels unusable: {type(e).__name__}: {e}"[:300]
        if not _state.modules:
            log.info("codec kernels: JIT (%s)", _state.reason)
        return _state.modules


def status() -> dict:
    """{"kernels": "aot" | "jit", "reason": why, "jit_fallbacks": {kernel: calls}}."""
    mods = _load()
    return {"kernels": "aot" if mods else "jit", "reason": _state.reason,
            "jit_fallbacks": dict(_state.fallbacks)}


class Kernel:
    """Calls the compiled variant of `name` matching the arguments, else the njit kernel."""

    def __init__(self, jit: Callable, name: str) -> None:
        self.jit, self.name = jit, name
        self._table: dict[tuple, Callable] | None = None

    def _variants(self) -> dict[tuple, Callable]:
        if self._table is None:
            mods = _load()
            self._table = {_key(kinds): getattr(mods[m], export)
                           for m, export, kinds in _variants(self.name) if m in mods}
        return self._table

    def __call__(self, *args):
        return self.variant(args)(*args)

    def variant(self, args: tuple) -> Callable:
        """The function a call with `args` runs: a caller making many calls whose arguments
        have the same types (a job over many small tensors of one dtype) looks it up once."""
        table = self._table if self._table is not None else self._variants()
        fn = table.get(_arg_key(args)) if table else None
        if fn is None:
            if table:
                _state.fallbacks[self.name] = _state.fallbacks.get(self.name, 0) + 1
            return self.jit
        return fn


def bind(jit: Callable, name: str) -> Kernel:
    if name not in SPEC:
        raise KeyError(f"{name} is not an ahead-of-time kernel (chain/codec/aot.py SPEC)")
    return Kernel(jit, name)
