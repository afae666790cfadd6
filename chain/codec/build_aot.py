"""Build the ahead-of-time codec and digest kernels (chain/codec/aot.py says what and why).

    python -m chain.codec.build_aot          # build (1-2 min); exit 1 if it could not
    python -m chain.codec.build_aot --check  # say whether the built modules are used, or why not

One process per element width, two at a time; the stamp (chain/codec/_aot.json) is written only
after every width built, so a failed or interrupted build leaves the JIT in use.
"""

import argparse
import importlib
import json
import subprocess
import sys
import time

from chain.codec.aot import (
    ELEMS,
    HERE,
    MODULE,
    SPEC,
    STAMP,
    _numba_sig,
    _variants,
    fingerprint,
)
from chain.codec.aot import status as aot_status


def build_width(width: str) -> int:
    """Compile one element width's variants into `chain/codec/_aot_<width><abi>` (one process per
    width: numba 0.68's AOT mis-types a kernel compiled for a second width in one process)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import numba.pycc.compiler as pcc
        from numba.pycc import CC

    class Flags(pcc.Flags):
        """What njit(nogil=True) sets: the wrapper releases the GIL around the kernel."""

        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            self.release_gil = True
            self.error_model = "python"

    pcc.Flags = Flags
    cc = CC(f"{MODULE}_{width}")
    cc.output_dir = str(HERE)
    cc.target_cpu = "host"
    cc.verbose = False
    n = 0
    for name, (modname, _) in SPEC.items():
        fn = getattr(importlib.import_module(modname), name).py_func
        for _, export, kinds in _variants(name, (width,)):
            cc.export(export, _numba_sig(kinds))(fn)
            n += 1
    cc.compile()
    return n


def build() -> dict:
    """Compile every width (a process each, two at a time) and write the stamp last."""
    t0 = time.perf_counter()
    STAMP.unlink(missing_ok=True)
    procs = []
    for w in ELEMS:
        procs.append(subprocess.Popen([sys.executable, "-m", "chain.codec.build_aot", "--width", w],
                                      cwd=str(HERE.parent.parent), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
        if len(procs) >= 2:
            _finish(procs.pop(0))
    for p in procs:
        _finish(p)
    modules = [f"{MODULE}_{w}" for w in ELEMS]
    STAMP.write_text(json.dumps({"built": fingerprint(), "modules": modules}, indent=1) + "\n")
    return {"modules": modules, "seconds": round(time.perf_counter() - t0, 1),
            "dir": str(HERE)}


def _finish(p: subprocess.Popen) -> None:
    _, err = p.communicate()
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(p.args[-2:])} failed: {err.strip()[-600:]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="report whether the module is used")
    p.add_argument("--width", choices=ELEMS, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.width:
        build_width(a.width)
        return 0
    if a.check:
        s = aot_status()
        print(json.dumps(s))
        return 0 if s["kernels"] == "aot" else 1
    try:
        print(json.dumps(build()))
    except Exception as e:  # no compiler, no pycc, ...: the JIT still works
        print(f"chain.codec.build_aot: could not compile the kernels ahead of time "
              f"({type(e).__name__}: {str(e)[:300]}); they will be JIT-compiled on first use",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
