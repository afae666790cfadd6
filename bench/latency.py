"""Where a small version's time goes, hop by hop: publish -> every region current, with regions
that bootstrap through a chain (trainer <- r1 <- r2 <- r3 on loopback, each region knowing only
the one before it), real daemons and a real Publisher (issue 19, item 4).

Each region is told only the one before it, but learns every other peer from the indexes it
reads, so in practice all regions hear of a version from the trainer's daemon at once and fetch
in parallel; the figures are therefore per region, from t0 = the publish call's return (the
version signed, written and seeded by the trainer's daemon), read from the daemons' own records
(status `transfers` and `applied`, unix times on this one machine):

- `ask`:      t0 -> this region's download started (head long-poll answered, index, manifest
              and torrent fetched, torrent added to libtorrent);
- `transfer`: download started -> all blocks on disk (libtorrent: connect, pieces, flush);
- `apply`:    blocks on disk -> current (adopt, verify, apply, journal);
- `current`:  t0 -> current; `total`: t0 -> the last region current (up to "current";
              bench/engine.py's small_delta_serve_s measures on to the engine serving).

    python bench/latency.py [--versions 12] [--hops 3] [--params 7e6] [--density 0.01]
                            [--interval 2] [--json]

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


def latency(versions: int = 12, hops: int = 3, params: float = 7e6, density: float = 0.01,
            gap_s: float = 0.3, interval_s: float = 0.0, root: Path | None = None,
            verbose: bool = False) -> dict:
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
        t0s: dict[int, float] = {}
        pubs: dict[int, object] = {}
        seen: dict[tuple[str, str], tuple[float, float, float]] = {}

        def collect() -> None:
            for n in names:
                for art in [f"v{v:08d}.delta" for v in t0s]:
                    if (n, art) not in seen and (r := _record(c.daemons[n], art)) is not None:
                        seen[(n, art)] = r

        for v in range(1, versions + 1):
            slot = time.time() + interval_s
            state = step(state, v, density)
            pubs[v] = c.publish(v, state)
            t0s[v] = time.time()
            if interval_s <= 0:
                c.wait_all_at(v, 120)
                collect()
                time.sleep(gap_s)
            else:  # a version every interval_s, whether or not the regions kept up
                while time.time() < slot:
                    collect()
                    time.sleep(0.2)
        c.wait_all_at(versions, 180)
        collect()
        for v in range(1, versions + 1):
            artifact, t0 = f"v{v:08d}.delta", t0s[v]
            row = {"version": v, "bytes": pubs[v].delta_bytes,
                   "publish_s": round(pubs[v].seconds, 3), "regions": []}
            for n in names:
                r = seen.get((n, artifact))
                if r is None:  # its record was dropped before we read it
                    row["regions"].append({"region": n})
                    continue
                started, secs, cur = r
                row["regions"].append({"region": n, "ask": round(started - t0, 3),
                                       "transfer": round(secs, 3),
                                       "apply": round(cur - started - secs, 3),
                                       "current": round(cur - t0, 3)})
            done = [h["current"] for h in row["regions"] if "current" in h]
            row["total"] = max(done) if len(done) == len(names) else None
            out.append(row)
            if verbose:
                print(json.dumps(row), flush=True)
        totals = [r["total"] for r in out if r["total"] is not None]
        med = {"total": statistics.median(totals) if totals else None}
        for part in ("ask", "transfer", "apply", "current"):
            vals = [h[part] for r in out for h in r["regions"] if part in h]
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
    ap.add_argument("--params", type=float, default=7e6)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--interval", type=float, default=0.0,
                    help="publish a version every this many seconds without waiting for the "
                         "regions (0: publish the next once all are current)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    load0 = os.getloadavg()
    res = latency(a.versions, a.hops, a.params, a.density, interval_s=a.interval,
                  verbose=not a.json)
    res["load_before"], res["load_after"] = load0, os.getloadavg()
    m = res["median"]
    print(f"params {res['params']:,}, density {a.density}, {a.hops} hops, {a.versions} versions; "
          f"median per region: ask {m['ask']}s, transfer {m['transfer']}s, apply {m['apply']}s, "
          f"current {m['current']}s; median publish -> all {a.hops} current: {m['total']}s; "
          f"load {tuple(round(x, 1) for x in res['load_before'])} -> "
          f"{tuple(round(x, 1) for x in res['load_after'])}")
    if a.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
