"""Regions as they are (issue 14): full `deltaswarm daemon` processes in network namespaces,
region-blind vs region-aware peering in the same run, optionally with churn. Needs root.

Each region is a router namespace with a fast LAN bridge (k nodes at --lan-mbit) and a tbf-shaped
veth to a core bridge (--wan-mbit each way; --slow-region-mbit for the last region); the trainer
sits on the first region's LAN behind its own uplink (--seed-mbit). Daemons run from config files
(region, role, bootstrap = the trainer). Per mode the trainer publishes one snapshot version
(the artifact, F bytes); a node holds it when its download finished with every piece verified
(its sync transfer record), and the run ends when every node's weights long-poll answers with the
trainer's state digest (applied; apply time is CPU, not topology, and is printed apart). Bytes
per link class come from the kernel's interface counters: into each region over its wan veth,
the trainer's eth0, and inside each region (bytes the bridge delivered to nodes, less what came
from the wan, the trainer and the monitor).

Ideal time for this topology (fluid bound, no latency): every byte starts at the trainer and must
leave the trainer's region once and enter every other region once, so
    T* = max(F/u_seed, F/wan_out(trainer region), max over other regions r of F/wan_in(r),
             F/lan, N*F/(u_seed + N*lan))
Modes: `blind` (every node dials every peer, peer exchange on), `aware` (daemon/peering/regions.py:
one gateway per region dials across), `+churn` suffix: at 40 % of T* kill -9 a third of the
nodes (at least one gateway outside the trainer's region) and start as many new ones.

    sudo .venv/bin/python bench/topo.py                          # 3 regions x 4, blind vs aware
    sudo .venv/bin/python bench/topo.py --modes aware+churn,blind+churn --json
    sudo .venv/bin/python bench/topo.py --nodes-per-region 6 --size-mb 32
"""

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import netns  # noqa: E402
from bench.topo_fleet import Fleet  # noqa: E402

REGION_NAMES = ("eu", "us", "ap", "sa", "af", "oc")


def ideal_time(f: int, args: argparse.Namespace, wans: dict[str, tuple[float, float]], n: int
               ) -> float:
    bits = f * 8 / 1e6
    home = next(iter(wans))
    terms = [bits / args.seed_mbit, bits / args.lan_mbit,
             n * bits / (args.seed_mbit + n * args.lan_mbit)]
    if len(wans) > 1:
        terms.append(bits / wans[home][0])
        terms += [bits / down for r, (_, down) in wans.items() if r != home]
    return max(terms)


def link_classes(net: netns.RegionNet, before: dict, after: dict, trainer: str) -> dict:
    def delta(ns: str, dev: str, i: int) -> int:
        a = after.get((ns, dev), (0, 0))[i]
        b = before.get((ns, dev), (0, 0))[i]
        return a - b

    tn = net.nodes[trainer]
    trainer_tx = delta(tn.ns, "eth0", 1)
    home = net.region_of[trainer]
    out = {"trainer_egress": trainer_tx, "into": {}, "out_of": {}, "intra": {}}
    for r in net.regions:
        rt = net.routers[r]
        into, leaving = delta(rt, "wan", 0), delta(rt, "wan", 1)
        delivered = sum(delta(link.ns, link.dev, 1) for name, link in net.ports.items()
                        if net.region_of[name] == r and name != trainer)
        intra = delivered - into - (trainer_tx if r == home else 0) - delta(rt, "mon", 0)
        out["into"][r], out["out_of"][r], out["intra"][r] = into, leaving, max(0, intra)
    return out


def run_mode(mode: str, args: argparse.Namespace, workdir: Path, log: list[str]) -> dict:
    peering, _, extra = mode.partition("+")
    churn = extra == "churn"
    regions = REGION_NAMES[:args.regions]
    wans = {r: (args.wan_mbit, args.wan_mbit) for r in regions}
    if args.slow_region_mbit:
        wans[regions[-1]] = (args.slow_region_mbit, args.slow_region_mbit)
    net = netns.RegionNet(prefix="dst")
    fleet = None
    try:
        net.build([(r, up, down) for r, (up, down) in wans.items()], args.lan_mbit)
        net.enter_monitor()
        fleet = Fleet(net, workdir / mode, peering, args)
        fleet.add("trainer", regions[0], trainer=True)
        for j in range(args.nodes_per_region):
            for r in regions:
                fleet.add(f"{r}-{j + 1}", r)
        fleet.start_all(timeout=120)
        meshed = fleet.wait_mesh(timeout=60)
        fleet.watch_weights()
        before = net.counters()
        published = fleet.publish_snapshot(args.size_mb)
        t0 = time.time()
        size = published["payload_bytes"]
        n = args.regions * args.nodes_per_region
        ideal = ideal_time(size, args, wans, n)
        churned: dict = {}
        deadline = time.monotonic() + args.timeout
        if churn:
            time.sleep(max(0.0, t0 + 0.4 * ideal - time.time()))
            churned = fleet.churn(random.Random(args.seed), regions[0])
        holds = fleet.wait_all(deadline)
        after = net.counters()
        links = link_classes(net, before, after, "trainer")
        statuses = fleet.statuses()
        fetched = fleet.fetched(statuses)
        everyone = len(holds) == len(fleet.live()) and len(fetched) == len(fleet.live())
        t_all = max(fetched.values()) - t0 if everyone else None
        t_applied = max(holds.values()) - t0 if everyone else None
        digest = published["state_digest"]
        verified = fleet.verified(digest)
        worst = max(links["into"].values()) / size
        payload_up = statuses.get("trainer", {}).get("totals", {}).get("bytes_up")
        result = {
            "artifact_bytes": size, "ideal_s": round(ideal, 3), "meshed": meshed,
            "time_s": round(t_all, 3) if t_all is not None else None,
            "time_over_ideal": round(t_all / ideal, 3) if t_all is not None else None,
            "applied_s": round(t_applied, 3) if t_applied is not None else None,
            "cross_region_over_artifact": round(worst, 3),
            "cross_region_by_region": {r: round(v / size, 3) for r, v in links["into"].items()},
            "out_of_region_by_region": {r: round(v / size, 3)
                                        for r, v in links["out_of"].items()},
            "intra_region_over_artifact": {r: round(v / size, 3)
                                           for r, v in links["intra"].items()},
            "trainer_egress_over_artifact": round(links["trainer_egress"] / size, 3),
            "trainer_payload_over_artifact": (round(payload_up / size, 3)
                                              if payload_up is not None else None),
            "all_verified": verified and t_all is not None,
            "per_node_s": {k: round(v - t0, 2) for k, v in sorted(fetched.items())},
            "gateways": fleet.gateways(statuses),
            "churn": churned,
        }
        if churned:
            new = set(churned["started"])
            old = [v for k, v in fetched.items() if k not in new]
            result["survivors_time_over_ideal"] = (round((max(old) - t0) / ideal, 3)
                                                   if old else None)
            result["new_nodes_download_s"] = fleet.download_seconds(statuses, new)
        return result
    finally:
        if fleet is not None:
            log.extend(fleet.stop_all())
        netns.RegionNet.leave_monitor()
        net.close()


def print_mode(mode: str, r: dict) -> None:
    print(f"\n== {mode}: artifact {r['artifact_bytes'] / 1e6:.1f} MB, ideal {r['ideal_s']:.2f} s"
          f"{'' if r['meshed'] else ' (mesh incomplete at publish)'}")
    t = f"{r['time_s']:.2f} s = {r['time_over_ideal']:.2f}x ideal" if r["time_s"] else "NOT ALL"
    print(f"time until every node holds it (pieces verified): {t}; applied by all at "
          f"{r['applied_s']} s; all on the trainer's digest: "
          f"{'yes' if r['all_verified'] else 'NO'}")
    print(f"trainer egress (wire) {r['trainer_egress_over_artifact']:.3f}x F, payload "
          f"{r['trainer_payload_over_artifact']}x F")
    print("into region over its wan (x F): " + ", ".join(
        f"{k} {v:.3f}" for k, v in r["cross_region_by_region"].items()))
    print("out of region (x F):            " + ", ".join(
        f"{k} {v:.3f}" for k, v in r["out_of_region_by_region"].items()))
    print("intra-region delivered (x F):   " + ", ".join(
        f"{k} {v:.3f}" for k, v in r["intra_region_over_artifact"].items()))
    print(f"gateways: {r['gateways']}")
    if r["churn"]:
        print(f"churn: {r['churn']}")
        print(f"survivors held it at {r['survivors_time_over_ideal']}x ideal; new nodes' own "
              f"download seconds (from their start): {r['new_nodes_download_s']}")
    print(f"per node (s): {r['per_node_s']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--regions", type=int, default=3)
    p.add_argument("--nodes-per-region", type=int, default=4)
    p.add_argument("--size-mb", type=float, default=48, help="snapshot size (bf16 weights)")
    p.add_argument("--seed-mbit", type=float, default=40, help="trainer uplink")
    p.add_argument("--wan-mbit", type=float, default=80, help="each region's link, each way")
    p.add_argument("--slow-region-mbit", type=float, default=0, help="the last region's link")
    p.add_argument("--lan-mbit", type=float, default=1000)
    p.add_argument("--piece-kib", type=int, default=256)
    p.add_argument("--block-mib", type=int, default=4)
    p.add_argument("--modes", default="blind,aware",
                   help="comma list of blind, aware, each optionally +churn")
    p.add_argument("--timeout", type=float, default=240, help="seconds per mode after publish")
    p.add_argument("--seed", type=int, default=1, help="random seed for churn")
    p.add_argument("--json", action="store_true", help="print one JSON summary line last")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m.partition("+")[0] not in ("blind", "aware")
           or m.partition("+")[2] not in ("", "churn")]
    if not modes or bad:
        p.error(f"--modes: blind / aware, optionally +churn; got {bad or args.modes!r}")
    if not 1 <= args.regions <= len(REGION_NAMES) or args.nodes_per_region < 1:
        p.error(f"--regions 1-{len(REGION_NAMES)}, --nodes-per-region >= 1")
    reason = netns.unavailable_reason()
    if reason:
        print(f"bench/topo.py: cannot run: {reason}", file=sys.stderr)
        return 2

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    workdir = Path(tempfile.mkdtemp(prefix=f"dstopo{os.getpid()}-"))
    results, log = {}, []
    try:
        for mode in modes:
            results[mode] = run_mode(mode, args, workdir, log)
            print_mode(mode, results[mode])
        summary = {"regions": args.regions, "nodes_per_region": args.nodes_per_region,
                   "seed_mbit": args.seed_mbit, "wan_mbit": args.wan_mbit,
                   "slow_region_mbit": args.slow_region_mbit, "lan_mbit": args.lan_mbit,
                   **results}
        if "blind" in results and "aware" in results:
            a, b = results["aware"], results["blind"]
            print(f"\naware vs blind: cross-region worst {a['cross_region_over_artifact']:.3f} vs "
                  f"{b['cross_region_over_artifact']:.3f}x F; time {a['time_over_ideal']} vs "
                  f"{b['time_over_ideal']}x ideal")
        for mode, r in results.items():
            if mode.startswith("aware"):
                print(f"goals ({mode}): cross-region <= 1.1x: {r['cross_region_over_artifact']}; "
                      f"trainer egress <= 1.05x: wire {r['trainer_egress_over_artifact']}, "
                      f"payload {r['trainer_payload_over_artifact']}; time <= 1.2x ideal: "
                      f"{r['time_over_ideal']}")
        if args.json:
            print(json.dumps(summary))
        return 0 if all(r["all_verified"] for r in results.values()) else 1
    except (TimeoutError, RuntimeError, netns.NetnsUnavailable) as exc:
        print(f"bench/topo.py: failed: {exc}", file=sys.stderr)
        for line in log[-20:]:
            print(line, file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"work directory kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
