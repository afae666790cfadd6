"""Per-version costs at real model sizes (issue 9): a Llama-shaped bf16 model (default about 1B
parameters), fp32 master weights moved by an Adam-like step so about 1 % of bf16 elements change
per version, several versions. Every figure is a ratio to baselines timed in the same run (one
comparison scan of the whole model, one sequential read of it, one `safetensors.save_file` of
it), printed next to the issue's goal with PASS/MISS.

    python bench/scale.py [--params 1e9 | --small] [--versions 3] [--json] [--no-e2e]
    python bench/scale.py --huge-tensor [--huge-elements 1.1e9]
    python bench/scale.py --ranks 2 [--small | --params 2e8] [--versions 3] [--rounds 2] --json
        # sharded publisher: 1 rank vs N ranks vs the single-process Publisher on the same
        # bytes; JSON keys sharded_1rank_over_publisher, ranks2_over_ranks1, mem_over_shard
        # (and *_cpu: the same ratios of CPU seconds, which other work inflates far less)

Each side runs in its own process (bench/scale_work.py) while this one samples its
/proc/<pid>/status and /proc/<pid>/io, so memory and disk writes are that side's alone.
Memory goals are judged on anonymous memory (RssAnon): RSS also counts page-cache pages of
mmap'd weight files, which the kernel can drop at will; both are printed.
"""

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
WORK = Path(__file__).resolve().parent / "scale_work.py"
RANK = Path(__file__).resolve().parent / "scale_rank.py"
VOCAB = 32000
DEPTHS = [(512, 4), (768, 8), (1024, 12), (1536, 12), (2048, 16), (2560, 20), (3072, 24),
          (4096, 32), (5120, 40), (8192, 80)]
GOALS = {"publish_over_scan": 2.0, "apply_over_scan": 2.0, "publisher_mem_over_model": 1.1,
         "region_mem_over_model": 0.25, "region_disk_over_model": 1.1}
console = Console(stderr=True)


def llama_size(hidden: int, layers: int) -> int:
    per_layer = hidden * hidden * 2 + 2 * hidden * (hidden // 4) + 3 * hidden * 4 * hidden
    return layers * (per_layer + 2 * hidden) + 2 * VOCAB * hidden + hidden


def choose_shape(params: float) -> tuple[int, int]:
    """The (hidden, layers) of usual Llama proportions whose size is closest to `params`."""
    best = None
    for hidden, depth in DEPTHS:
        per_layer = llama_size(hidden, 1) - llama_size(hidden, 0)
        layers = round((params - llama_size(hidden, 0)) / per_layer)
        if layers < 1:
            continue
        score = abs(math.log(layers / depth))
        if best is None or score < best[0]:
            best = (score, hidden, layers)
    if best is None:
        raise SystemExit(f"--params {params:.3g} is too small for a Llama shape (min ~{2e7:.0e})")
    return best[1], best[2]


def proc_values(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) * 1024
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            key, value = line.split(":")
            if key in ("write_bytes", "wchar", "cancelled_write_bytes"):
                out[key] = int(value)
    with open(f"/proc/{pid}/stat") as f:  # utime, stime: fields 14, 15 (after the "(comm)")
        fields = f.read().rsplit(")", 1)[1].split()
    out["cpu_ticks"] = int(fields[11]) + int(fields[12])
    return out


class Child:
    """One scale_work.py role; a sampler thread keeps the peak RssAnon/VmRSS since the last
    begin mark, and each begin/end mark pair becomes one measured phase."""

    def __init__(self, role: str, work: Path, argv: list[str] | None = None,
                 env_extra: dict[str, str] | None = None) -> None:
        self.role = role
        env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
        argv = argv or [str(WORK), role, str(work)]
        self.proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.lock = threading.Lock()
        self.now: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.base: dict[str, int] = {}
        self.boot: dict[str, int] = {}
        self.phases: list[dict] = []
        self.results: list[dict] = []
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while self.proc.poll() is None:
            try:
                values = proc_values(self.proc.pid)
            except (OSError, ValueError):
                break
            if "RssAnon" not in values:  # exited, not yet reaped
                break
            with self.lock:
                self.now = values
                for k in ("VmRSS", "RssAnon"):
                    self.peak[k] = max(self.peak.get(k, 0), values[k])
            time.sleep(0.005)

    def _fresh(self) -> dict[str, int]:
        values = proc_values(self.proc.pid)
        with self.lock:
            self.now = values
            for k in ("VmRSS", "RssAnon"):
                self.peak[k] = max(self.peak.get(k, 0), values[k])
        return values

    def run(self) -> "Child":
        start: dict[str, int] = {}
        assert self.proc.stdout is not None and self.proc.stdin is not None
        for line in self.proc.stdout:
            if not line.startswith("@@ "):
                console.print(f"  [dim]{self.role}: {line.rstrip()}[/dim]")
                continue
            doc = json.loads(line[3:])
            if doc.get("mark") == "boot":  # before any warm-up
                self.boot = self._fresh()
            elif doc.get("mark") == "base":
                self.base = self._fresh()
            elif doc.get("mark") == "begin":
                start = self._fresh()
                with self.lock:
                    self.peak = {k: start[k] for k in ("VmRSS", "RssAnon")}
            elif doc.get("mark") == "end":
                end = self._fresh()
                with self.lock:
                    peak = dict(self.peak)
                self.phases.append({
                    "label": doc["label"], **doc["result"],
                    "anon_peak": peak["RssAnon"], "rss_peak": max(peak["VmRSS"], doc["hwm"]),
                    "base_anon": self.base.get("RssAnon", start["RssAnon"]),
                    "base_rss": self.base.get("VmRSS", start["VmRSS"]),
                    "write_bytes": (end["write_bytes"] - start["write_bytes"])
                    - (end["cancelled_write_bytes"] - start["cancelled_write_bytes"]),
                    "wchar": end["wchar"] - start["wchar"],
                    # CPU seconds of all its threads: what other work on the host inflates
                    # far less than wall time
                    "cpu_s": (end["cpu_ticks"] - start["cpu_ticks"]) / os.sysconf("SC_CLK_TCK")})
            elif "result" in doc:
                self.results.append(doc["result"])
            if "mark" in doc:
                self.proc.stdin.write("\n")
                self.proc.stdin.flush()
        if self.proc.wait() != 0:
            raise SystemExit(f"bench/scale_work.py {self.role} failed with exit code "
                             f"{self.proc.returncode}")
        return self


def code_rev() -> str:
    """The last commit that changed the measured code (chain, daemon, trainer)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True
                              ).stdout.strip()
    parts = ("chain", "daemon", "trainer")
    return (git("log", "-1", "--format=%h %s", "--", *parts)[:60]
            + (" (+ uncommitted changes)" if git("status", "--porcelain", "--", *parts) else ""))


def verdict(key: str, value: float) -> str:
    return "[green]PASS[/green]" if value <= GOALS[key] else "[red]MISS[/red]"


def measure(args: argparse.Namespace, work: Path) -> dict:
    hidden, layers = choose_shape(args.params)
    params = llama_size(hidden, layers)
    cfg = {"hidden": hidden, "layers": layers, "versions": args.versions,
           "density": args.density, "seed": args.seed, "e2e_timeout": args.e2e_timeout}
    (work / "config.json").write_text(json.dumps(cfg))
    model = 2 * params
    console.print(f"model: Llama-shaped, hidden {hidden}, {layers} layers, {params / 1e9:.3f}B "
                  f"params, {model / 2**30:.2f} GiB bf16; {args.versions} delta versions; "
                  f"code {code_rev()}; load average {os.getloadavg()[0]:.1f} (2 cores shared)")
    t0 = time.perf_counter()
    Child("gen", work).run()
    console.print(f"versions written in {time.perf_counter() - t0:.0f}s")
    before = Child("baseline", work).run().results[0]
    pub = Child("publish", work).run().phases
    reg = Child("region", work).run().phases
    after = Child("baseline", work).run().results[0]
    e2e = Child("e2e", work).run().results if args.e2e else []
    # Baselines timed before and after the measured sides; the faster of each is used, so a
    # busy moment during a baseline never flatters a ratio.
    base = {k: min(before[k], after[k]) for k in ("scan_s", "read_s", "save_s")}
    density = statistics.mean(c / before["elements"] for c in before["changed"])
    scan = base["scan_s"]

    rows = []
    for p, r in zip(pub, reg, strict=True):
        rows.append({
            "version": p["version"], "kind": p["kind"],
            "publish_s": p["seconds"], "apply_s": r["seconds"], "current_ok": r["current_ok"],
            "publisher_anon": p["anon_peak"] - p["base_anon"] - p["caller_bytes"],
            "publisher_rss": p["rss_peak"] - p["base_rss"] - p["caller_bytes"],
            "region_anon": r["anon_peak"] - r["base_anon"],
            "region_rss": r["rss_peak"] - r["base_rss"],
            "publisher_write": p["write_bytes"], "region_write": r["write_bytes"],
            "region_wchar": r["wchar"], "artifact_bytes": p["artifact_bytes"],
            "density": p["changed"] / p["elements"]})
    deltas = [row for row in rows if row["kind"] == "delta"]
    med = lambda k: statistics.median(row[k] for row in deltas)  # noqa: E731
    top = lambda k: max(row[k] for row in deltas)  # noqa: E731
    out = {
        "params": params, "model_bytes": model, "hidden": hidden, "layers": layers,
        "versions": args.versions, "density": density, "code": code_rev(),
        "scan_s": scan, "read_s": base["read_s"], "save_s": base["save_s"],
        "scan_s_runs": [before["scan_s"], after["scan_s"]],
        "publish_s": med("publish_s"), "apply_s": med("apply_s"),
        "publish_over_scan": med("publish_s") / scan, "apply_over_scan": med("apply_s") / scan,
        "publish_over_save": med("publish_s") / base["save_s"],
        "apply_over_save": med("apply_s") / base["save_s"],
        "apply_over_read": med("apply_s") / base["read_s"],
        "publisher_mem_over_model": top("publisher_anon") / model,
        "publisher_rss_over_model": top("publisher_rss") / model,
        "region_mem_over_model": top("region_anon") / model,
        "region_rss_over_model": top("region_rss") / model,
        "publisher_disk_over_model": top("publisher_write") / model,
        "region_disk_over_model": top("region_write") / model,
        "region_wchar_over_model": top("region_wchar") / model,
        "all_current_ok": all(row["current_ok"] for row in rows),
        "end_to_end_s": (statistics.median(e["end_to_end_s"] for e in e2e if e["version"])
                         if e2e else None),
        "e2e_bootstrap_s": e2e[0]["end_to_end_s"] if e2e else None,
        "e2e_digests_ok": all(e["digests_ok"] for e in e2e) if e2e else None,
        "load_average": os.getloadavg()[0],
    }
    report(out, rows, e2e)
    return out


def measure_ranks(args: argparse.Namespace, work: Path) -> dict:
    """The sharded publisher on the same versions with 1 rank and with `--ranks` ranks (gloo,
    one process each, dim-0 shards), and the single-process Publisher on the same bytes, in
    `--rounds` rounds of (Publisher, 1 rank, N ranks): a side's time is the median of its
    delta versions in its fastest round, so other work on the host, which only ever adds,
    disturbs no side more than another. Also each rank's peak anonymous memory beyond its own
    shard (as a ratio to that shard, worst of all versions and rounds; the fixed per-process
    warm-up is reported apart), and device->host bytes against the delta."""
    hidden, layers = choose_shape(args.params)
    params = llama_size(hidden, layers)
    (work / "config.json").write_text(json.dumps({
        "hidden": hidden, "layers": layers, "versions": args.versions, "density": args.density,
        "seed": args.seed}))
    console.print(f"model: Llama-shaped, hidden {hidden}, {layers} layers, {params / 1e9:.3f}B "
                  f"params, {2 * params / 2**30:.2f} GiB bf16; {args.versions} delta versions; "
                  f"{args.rounds} rounds; code {code_rev()}; load average "
                  f"{os.getloadavg()[0]:.1f} (2 cores shared)")
    Child("gen", work).run()
    worlds = sorted({1, args.ranks})
    runs: dict = {"publisher": [], **{w: [] for w in worlds}}
    loads: list[float] = []
    for _ in range(args.rounds):
        shutil.rmtree(work / "pub", ignore_errors=True)
        loads.append(os.getloadavg()[0])
        runs["publisher"].append(Child("publish", work).run().phases)
        for world in worlds:
            shutil.rmtree(work / f"ranks{world}", ignore_errors=True)
            loads.append(os.getloadavg()[0])
            runs[world].append(run_ranks(work, world))

    def median_s(phases: list[dict]) -> float:
        return statistics.median(p["seconds"] for p in phases if p["kind"] == "delta")

    pub_s = [median_s(r) for r in runs["publisher"]]
    pub_cpu = [statistics.median(p["cpu_s"] for p in r if p["kind"] == "delta")
               for r in runs["publisher"]]
    out: dict = {"params": params, "versions": args.versions, "rounds": args.rounds,
                 "code": code_rev(), "worlds": {}, "load_average": loads,
                 "publisher_s": min(pub_s), "publisher_s_rounds": pub_s,
                 "publisher_cpu_s": min(pub_cpu), "publisher_cpu_s_rounds": pub_cpu}
    t = Table(title="sharded publish (delta versions: median time in the fastest round, "
                    "worst memory)")
    for col in ("ranks", "publish s", "rounds", "of which encoding (slowest rank)",
                "CPU s (all ranks)",
                "per-rank mem beyond shard / shard (worst)",
                "fixed MB a rank", "density", "d2h / sparse delta (int32 pos + value)",
                "d2h / encoded delta"):
        t.add_column(col, justify="right")
    t.add_row("Publisher", f"{min(pub_s):.2f}", ", ".join(f"{x:.2f}" for x in pub_s),
              "", f"{min(pub_cpu):.2f}", "", "", "", "", "")
    for world in worlds:
        rounds = runs[world]
        secs = [statistics.median(r["secs"]) for r in rounds]
        first = rounds[0]["first"]
        changed = sum(p["changed"] for p in first)
        sparse = sum(p["changed"] * (4 + 2) for p in first)  # int32 position + bf16 value
        d2h = sum(p["d2h"] for p in first)
        encoded = sum(p["artifact_bytes"] for p in first)
        best = secs.index(min(secs))
        cpu = [statistics.median(r["cpu_secs"]) for r in rounds]
        row = {"publish_s": min(secs), "publish_s_rounds": secs,
               "cpu_s": min(cpu), "cpu_s_rounds": cpu,
               "encode_s": statistics.median(rounds[best]["encode_secs"]),
               "publish_s_all": [r["secs"] for r in rounds],
               "mem_over_shard": max(r["mem"] for r in rounds),
               "shard_bytes": rounds[0]["shard"],
               "fixed_bytes": max(r["fixed"] for r in rounds),
               "density": changed / sum(p["elements"] for p in first),
               "d2h_over_sparse": d2h / max(1, sparse), "d2h_over_encoded": d2h / max(1, encoded)}
        out["worlds"][world] = row
        t.add_row(str(world), f"{row['publish_s']:.2f}", ", ".join(f"{x:.2f}" for x in secs),
                  f"{row['encode_s']:.2f}", f"{row['cpu_s']:.2f}", f"{row['mem_over_shard']:.2f}x",
                  f"{row['fixed_bytes'] / 2**20:.0f}",
                  f"{row['density']:.4f}", f"{row['d2h_over_sparse']:.2f}x",
                  f"{row['d2h_over_encoded']:.2f}x")
    console.print(t)
    one, many = out["worlds"][1], out["worlds"][args.ranks]
    out["sharded_1rank_over_publisher"] = one["publish_s"] / out["publisher_s"]
    out[f"ranks{args.ranks}_over_ranks1"] = many["publish_s"] / one["publish_s"]
    out["speedup"] = one["publish_s"] / many["publish_s"]
    out["sharded_1rank_over_publisher_cpu"] = one["cpu_s"] / out["publisher_cpu_s"]
    out[f"ranks{args.ranks}_over_ranks1_cpu"] = many["cpu_s"] / one["cpu_s"]
    out["mem_over_shard"] = max(w["mem_over_shard"] for w in out["worlds"].values())
    console.print(f"1 rank vs the single-process Publisher on the same bytes: "
                  f"{out['sharded_1rank_over_publisher']:.2f}x its time (goal <= 1.2x), "
                  f"{out['sharded_1rank_over_publisher_cpu']:.2f}x its CPU seconds; "
                  f"{args.ranks} ranks together {out[f'ranks{args.ranks}_over_ranks1_cpu']:.2f}x "
                  "the CPU seconds of 1")
    console.print(f"{args.ranks} ranks vs 1: {out[f'ranks{args.ranks}_over_ranks1']:.2f}x the "
                  f"time (goal <= 1x on this 2-core machine); per-rank memory beyond its shard "
                  f"{many['mem_over_shard']:.2f}x the shard (goal <= 1.1x) plus a fixed "
                  f"{many['fixed_bytes'] / 2**20:.0f} MB a process; device->host bytes "
                  f"{many['d2h_over_sparse']:.2f}x the sparse delta (goal <= 1.2x; 0 where the "
                  f"shard is on the host and encoded in one pass), "
                  f"{many['d2h_over_encoded']:.2f}x the encoded delta; load averages "
                  f"{', '.join(f'{x:.1f}' for x in loads)}")
    return out


def run_ranks(work: Path, world: int) -> dict:
    """One run of `world` rank processes over the versions: per delta version the slowest
    rank's time, the worst rank's memory beyond its shard, rank 0's phases."""
    from rollout.ports import free_port  # outside the ephemeral range: the ranks bind it later

    port = free_port()
    # fixed mmap threshold: freed tensors go back to the kernel, so RssAnon is what the
    # publisher holds, not what glibc kept of the previous version's tensors; every rank is
    # on this host, as torchrun would say (LOCAL_WORLD_SIZE: the ranks share its cores)
    kids = [Child(f"rank{r}", work, [str(RANK), str(work), str(r), str(world), str(port)],
                  {"MALLOC_MMAP_THRESHOLD_": "131072", "LOCAL_WORLD_SIZE": str(world)})
            for r in range(world)]
    threads = [threading.Thread(target=k.run) for k in kids]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    deltas = [[p for p in k.phases if p["kind"] == "delta"] for k in kids]
    return {"secs": [max(k[i]["seconds"] for k in deltas) for i in range(len(deltas[0]))],
            "encode_secs": [deltas[0][i]["encode_s"] for i in range(len(deltas[0]))],
            "cpu_secs": [sum(k[i]["cpu_s"] for k in deltas) for i in range(len(deltas[0]))],
            "mem": max((p["anon_peak"] - p["base_anon"] - p["caller_bytes"]) / p["caller_bytes"]
                       for k in deltas for p in k),
            "shard": max(p["caller_bytes"] for k in deltas for p in k),
            "fixed": max(k.base["RssAnon"] - k.boot["RssAnon"] for k in kids),
            "first": deltas[0]}


def report(out: dict, rows: list[dict], e2e: list[dict]) -> None:
    model = out["model_bytes"]
    t = Table(title="per version (publisher and region each in its own process)")
    for col in ("v", "kind", "density", "publish s", "apply s", "pub anon/model",
                "pub rss/model", "region anon/model", "region rss/model", "pub disk/model",
                "region disk/model", "e2e s"):
        t.add_column(col, justify="right")
    by_v = {e["version"]: e for e in e2e}
    for row in rows:
        e = by_v.get(row["version"])
        t.add_row(str(row["version"]), row["kind"], f"{row['density']:.4f}",
                  f"{row['publish_s']:.2f}", f"{row['apply_s']:.2f}",
                  f"{row['publisher_anon'] / model:.2f}", f"{row['publisher_rss'] / model:.2f}",
                  f"{row['region_anon'] / model:.2f}", f"{row['region_rss'] / model:.2f}",
                  f"{row['publisher_write'] / model:.2f}", f"{row['region_write'] / model:.2f}",
                  f"{e['end_to_end_s']:.1f}" if e else "-")
    console.print(t)
    console.print(f"baselines (faster of before/after): one scan {out['scan_s']:.2f}s "
                  f"(runs {out['scan_s_runs'][0]:.2f}s, {out['scan_s_runs'][1]:.2f}s), one "
                  "sequential read "
                  f"{out['read_s']:.2f}s (warm page cache), save_file "
                  f"{out['save_s']:.2f}s; measured density {out['density']:.4f}")
    g = Table(title="goals (delta versions: median time, worst memory and disk)")
    for col in ("figure", "value", "goal", "", "also"):
        g.add_column(col)
    g.add_row("publish / scan", f"{out['publish_over_scan']:.1f}x", "<= 2x",
              verdict("publish_over_scan", out["publish_over_scan"]),
              f"{out['publish_s']:.2f}s; {out['publish_over_save']:.2f}x save_file")
    g.add_row("region apply+verify / scan", f"{out['apply_over_scan']:.1f}x", "<= 2x",
              verdict("apply_over_scan", out["apply_over_scan"]),
              f"{out['apply_s']:.2f}s; {out['apply_over_save']:.2f}x save_file, "
              f"{out['apply_over_read']:.1f}x read")
    g.add_row("publisher anon memory beyond caller / model",
              f"{out['publisher_mem_over_model']:.2f}x", "<= 1.1x",
              verdict("publisher_mem_over_model", out["publisher_mem_over_model"]),
              f"RSS {out['publisher_rss_over_model']:.2f}x")
    g.add_row("region anon memory / model", f"{out['region_mem_over_model']:.2f}x", "<= 0.25x",
              verdict("region_mem_over_model", out["region_mem_over_model"]),
              f"RSS {out['region_rss_over_model']:.2f}x (mmap'd page cache)")
    g.add_row("region disk writes / model", f"{out['region_disk_over_model']:.2f}x", "<= 1.1x",
              verdict("region_disk_over_model", out["region_disk_over_model"]),
              f"write() calls {out['region_wchar_over_model']:.2f}x; publisher "
              f"{out['publisher_disk_over_model']:.3f}x")
    console.print(g)
    if out["end_to_end_s"] is not None:
        console.print(f"end to end (trainer daemon + 2 region daemons, loopback): bootstrap v0 "
                      f"{out['e2e_bootstrap_s']:.1f}s, publish -> every region current "
                      f"{out['end_to_end_s']:.1f}s (median of deltas); digests "
                      f"{'match' if out['e2e_digests_ok'] else 'DIFFER'}")
    for size in (7e9, 70e9):
        k = size / out["params"]
        console.print(f"extrapolated linearly to {size / 1e9:.0f}B: publish "
                      f"{out['publish_s'] * k:.0f}s, region apply {out['apply_s'] * k:.0f}s "
                      "per version")
    if not out["all_current_ok"]:
        console.print("[red]a region apply did not end current on the published digest[/red]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=1e9, help="model size (default 1e9)")
    ap.add_argument("--small", action="store_true", help="a ~50M-parameter quick run")
    ap.add_argument("--versions", type=int, default=3, help="delta versions after v0")
    ap.add_argument("--density", type=float, default=0.01, help="target changed fraction")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-e2e", dest="e2e", action="store_false",
                    help="skip the run through real daemons")
    ap.add_argument("--e2e-timeout", type=float, default=900.0)
    ap.add_argument("--huge-tensor", action="store_true",
                    help="only round-trip one tensor above 2^31 bytes")
    ap.add_argument("--huge-elements", type=float, default=1.1e9)
    ap.add_argument("--workdir", type=Path, help="default: a temp dir, removed afterwards")
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    ap.add_argument("--ranks", type=int, help="compare the sharded publisher on 1 and N ranks")
    ap.add_argument("--rounds", type=int, default=2,
                    help="with --ranks: rounds of (Publisher, 1 rank, N ranks); each side's "
                         "fastest round is used")
    args = ap.parse_args()
    if args.small:
        args.params = 5e7
    if args.versions < 1:
        ap.error("--versions must be at least 1")
    work = Path(tempfile.mkdtemp(prefix="scale-", dir=args.workdir))
    try:
        if args.huge_tensor:
            (work / "config.json").write_text(json.dumps(
                {"huge_elements": int(args.huge_elements)}))
            out = Child("huge", work).run().results[0]
            out["code"] = code_rev()
            if out["huge_bytes"] <= 1 << 31:
                console.print("[yellow]the tensor is not above 2^31 bytes: this run proves "
                              "nothing about 32-bit offsets[/yellow]")
            console.print(f"one tensor of {out['huge_bytes'] / 2**30:.2f} GiB, "
                          f"{out['changed']} changes, through snapshot, delta, blocks and "
                          f"apply: {'bit-exact PASS' if out['bit_exact'] else 'DIFFERS: FAIL'}")
        elif args.ranks:
            out = measure_ranks(args, work)
        else:
            out = measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(out))
    if args.huge_tensor and not out["bit_exact"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
