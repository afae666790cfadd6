"""How much coding the codec's second thread gets done while the main thread runs Python.

The publish of a 50,000-tensor model spends ~0.4 s of main-thread Python a version (the walk,
each group's records, the manifest) where the codec's worker could code the next batch, but
it needs the GIL around every segment's kernel call, and a thread that wants the GIL waits
up to the interpreter's switch interval for a thread that runs Python to let go of it
(docs/MEASURED.md, stops 52-54). This measures that wait directly: a worker codes 2^20-element
bf16 segments (1 % changed) one `encode_changes` call at a time, alone and then while the main
thread builds dicts for `--seconds`, at each switch interval; it prints the worker's rate
during the Python over its rate alone, and the Python's rate over its own alone. A segment
takes the GIL back after each call that let go of it (the coding kernel, the gather of its
new values, the digest move), so the worker's rate falls with the wait times those calls; a
kernel that coded a run of segments, gather and moves included, would wait once a run.

    python bench/gil_handoff.py [--seconds 1] [--json]
"""

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chain import codec

SEGMENT = 1 << 20


def segment_pair() -> tuple[np.ndarray, np.ndarray]:
    """Old and new bit patterns of one segment, 1 % of the elements one step apart."""
    rng = np.random.default_rng(0)
    old = rng.integers(0, 2**16, SEGMENT, dtype=np.uint16)
    new = old.copy()
    new[rng.choice(old.size, old.size // 100, replace=False)] += 1
    return old, new


def python_rate(seconds: float) -> float:
    """Rounds a second of plain Python work (dicts of tuples, strings and lists)."""
    d: dict = {}
    t0, rounds = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        for i in range(1000):
            d[i] = (i, str(i), [i])
        rounds += 1
    return rounds / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    old, new = segment_pair()

    def code() -> None:
        codec.encode_changes([(old, new, "bfloat16")], threads=1)

    for _ in range(3):
        code()  # the kernels loaded and the workspace grown before any timing
    print(f"load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    t0, calls = time.perf_counter(), 0
    while time.perf_counter() - t0 < a.seconds:
        code()
        calls += 1
    alone = calls / a.seconds
    python_alone = python_rate(a.seconds)
    default = sys.getswitchinterval()
    result: dict = {"load_avg_1m": round(os.getloadavg()[0], 2),
                    "calls_per_s_alone": round(alone, 1), "by_switch_interval_ms": {}}
    try:
        for interval in (0.005, 0.001, 0.0002):
            sys.setswitchinterval(interval)
            done = [0]
            stop = threading.Event()

            def worker(done: list[int] = done, stop: threading.Event = stop) -> None:
                while not stop.is_set():
                    code()
                    done[0] += 1

            th = threading.Thread(target=worker, name="codec-bench")
            th.start()
            try:
                time.sleep(0.1)
                before = done[0]
                rate = python_rate(a.seconds)
                during = (done[0] - before) / a.seconds
            finally:
                stop.set()
                th.join()
            row = {"worker_over_alone": round(during / alone, 3),
                   "python_over_alone": round(rate / python_alone, 3)}
            result["by_switch_interval_ms"][f"{interval * 1e3:g}"] = row
            print(f"switch interval {interval * 1e3:g} ms: the worker codes at "
                  f"{row['worker_over_alone']:.2f}x its rate alone while the main thread runs "
                  f"Python, which runs at {row['python_over_alone']:.2f}x its own",
                  file=sys.stderr)
    finally:
        sys.setswitchinterval(default)
    if a.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
