"""Issue 11's chaos run several times in a row (the test runs it once): for each run, the time
from the last publish until every live region holds it with the trainer's digest, against the
bound derived in that same run, the time from the trainer daemon's restart until the original
regions are current again, and which properties held (tests/integration/chaos_checks.py).

    .venv/bin/python bench/chaos.py --runs 5
    .venv/bin/python bench/chaos.py --runs 5 --json --verbose

Each run takes ~1.5-2 min on two cores (real daemons, a 7.3M-parameter model); every process is
stopped and every temp dir removed after each run. Exit status 1 when any run broke a property.
"""

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests.integration.chaos_checks import CHECKS, describe  # noqa: E402
from tests.integration.chaos_record import Params  # noqa: E402
from tests.integration.chaos_scenario import run_scenario  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--final", type=int, default=Params.final, help="last version published")
    ap.add_argument("--interval", type=float, default=Params.interval_s,
                    help="seconds between versions")
    ap.add_argument("--json", action="store_true", help="one JSON line per run, then a summary")
    ap.add_argument("--keep-failed", action="store_true",
                    help="keep a failed run's state dirs and logs (the path is printed)")
    ap.add_argument("--verbose", action="store_true",
                    help="print each run's timeline as it happens (a failed run's is always "
                    "printed after it)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    params = dataclasses.replace(Params(), final=args.final, interval_s=args.interval)
    rows = []
    for i in range(1, args.runs + 1):
        root = Path(tempfile.mkdtemp(prefix="chaos-"))
        t0 = time.monotonic()
        run = None
        try:
            run = run_scenario(root, params, log=print if args.verbose else lambda _: None)
            failed = {name: probs for name, probs in ((n, f(run)) for n, f in CHECKS.items())
                      if probs}
        finally:
            if run is not None and failed and args.keep_failed:
                print(f"kept {root}", flush=True)
            else:
                shutil.rmtree(root, ignore_errors=True)
        row = {"run": i, "converge_s": run.converge_s, "bound_s": run.bound_s,
               "restart_to_current_s": run.restart_to_current_s,
               "wall_s": round(time.monotonic() - t0, 1), "failed": failed}
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"run {i}/{args.runs}: converged in {run.converge_s}s (bound {run.bound_s}s), "
                  f"trainer restart -> all current {run.restart_to_current_s}s, "
                  f"wall {row['wall_s']}s: "
                  + ("all properties held" if not failed else
                     "FAILED " + "; ".join(f"{k}: {v[0]}" for k, v in failed.items())),
                  flush=True)
        if failed:
            print(describe(run), flush=True)
    times = [r["converge_s"] for r in rows if r["converge_s"] is not None]
    summary = {"runs": len(rows), "passed": sum(not r["failed"] for r in rows),
               "converge_s": [r["converge_s"] for r in rows],
               "median_s": statistics.median(times) if times else None,
               "max_s": max(times) if times else None}
    print(json.dumps(summary) if args.json else
          f"{summary['passed']}/{summary['runs']} runs held every property; time to converge "
          f"{summary['converge_s']} (median {summary['median_s']}, max {summary['max_s']})")
    return 0 if summary["passed"] == summary["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
