"""Where a small version's time goes, hop by hop: publish -> every region current, with regions
that bootstrap through a chain (trainer <- r1 <- r2 <- r3 on loopback, each region knowing only
the one before it), real daemons and a real Publisher (issue 19, item 4).

For each delta version, from the region daemons' own records (status `transfers` and `applied`,
unix times on this one machine) and the publish return time t0:

- `ask`:      previous hop current (t0 for r1) -> this region's download started (head long-poll
              answered, index, manifest and torrent fetched, torrent added);
- `transfer`: download started -> all blocks on disk (libtorrent: connect, pieces, flush);
- `apply`:    blocks on disk -> current (adopt, verify, apply, journal);
- `hop`:      the sum; `total`: t0 -> the last region current.

    python bench/latency.py [--versions 12] [--hops 3] [--params 4e6] [--density 0.01] [--json]

`latency(...)` returns the same figures for other benches (bench/engine.py).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.harness import Cluster, step, tiny_model  # noqa: E402
from tests.support import wait_until  # noqa: E402


def _record(d, artifact: str) -> tuple[float, float, float] | None:
    """(download started, download seconds, current at) of one artifact at one region."""
    st = d.status()["detail"]["sync"]
    tr = st.get("transfers", {}).get(artifact)
    ap = next((a for a in st.get("applied", []) if a["artifact"] == artifact), None)
    if tr is None or ap is None or tr.get("seconds") is None:
        return None
    return tr["started"], tr["seconds"], ap["time"]


def latency(versions: int = 12, hops: int = 3, params: float = 4e6, density: float = 0.01,
            gap_s: float = 0.3, root: Path | None = None, verbose: bool = False) -> dict:
    """Run the chain and return per-version rows and medians (seconds)."""
    cols = 1024
    tensors = 8
    rows = max(16, int(params) // (tensors * cols))
    with tempfile.TemporaryDirectory(prefix="latency-", dir=root) as tmp, \
            Cluster(Path(tmp)) as c:
        c.trainer()
        names = [f"r{i + 1}" for i in range(hops)]
        prev = c.daemons["trainer"].url
        for n in names:
            prev = c.region(n, bootstrap=[prev], sync={"head_wait_s": 1.0}).url
        c.start_all()
        state = tiny_model(tensors=tensors, rows=rows, cols=cols)
        c.publish(0, state, snapshot=True)
        c.wait_all_at(0, 180)
        out = []
        for v in range(1, versions + 1):
            state = step(state, v, density)
            out_pub = c.publish(v, state)
            t0 = time.time()
            c.wait_all_at(v, 120)
            artifact = f"v{v:08d}.delta"
            recs = [_record(c.daemons[n], artifact) for n in names]
            before, row = t0, {"version": v, "bytes": out_pub.delta_bytes, "hops": []}
            for n, r in zip(names, recs, strict=True):
                if r is None:  # nothing downloaded (held already?): time to current only
                    row["hops"].append({"region": n})
                    continue
                started, secs, cur = r
                row["hops"].append({"region": n, "ask": round(started - before, 3),
                                    "transfer": round(secs, 3),
                                    "apply": round(cur - started - secs, 3),
                                    "hop": round(cur - before, 3)})
                before = cur
            row["total"] = round(before - t0, 3)
            out.append(row)
            if verbose:
                print(json.dumps(row), flush=True)
            time.sleep(gap_s)
        med = {"total": statistics.median(r["total"] for r in out)}
        for part in ("ask", "transfer", "apply", "hop"):
            vals = [h[part] for r in out for h in r["hops"] if part in h]
            med[part] = statistics.median(vals) if vals else None
        c.stop_all()
        wait_until(lambda: all(d.proc.poll() is not None for d in c.daemons.values()), 30,
                   "daemons to stop")
    return {"rows": out, "median": med, "versions": versions, "hops": hops,
            "params": tensors * rows * cols, "density": density}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", type=int, default=12)
    ap.add_argument("--hops", type=int, default=3)
    ap.add_argument("--params", type=float, default=4e6)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    load0 = os.getloadavg()
    res = latency(a.versions, a.hops, a.params, a.density, verbose=not a.json)
    res["load_before"], res["load_after"] = load0, os.getloadavg()
    m = res["median"]
    print(f"params {res['params']:,}, density {a.density}, {a.hops} hops, {a.versions} versions; "
          f"median per hop: ask {m['ask']}s, transfer {m['transfer']}s, apply {m['apply']}s, "
          f"hop {m['hop']}s; median publish -> all {a.hops} current: {m['total']}s; "
          f"load {tuple(round(x, 1) for x in res['load_before'])} -> "
          f"{tuple(round(x, 1) for x in res['load_after'])}")
    if a.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
