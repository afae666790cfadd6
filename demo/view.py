"""What the demo shows: the live table, the closing summary, the verdict and the PNG."""

import json
import statistics
from pathlib import Path

from rich.console import Group
from rich.table import Table
from rich.text import Text


def _kib(n: float | None) -> str:
    return "-" if n is None else f"{n / 1024:,.1f} KiB"


def _steps(metrics: list[dict]) -> list[dict]:
    return [m for m in metrics if m.get("event") == "step"]


def region_share(statuses: dict[str, dict | None]) -> tuple[int, int, float]:
    """(bytes regions uploaded, bytes regions downloaded, share of region downloads that came
    from other regions rather than the trainer)."""
    up = sum((s or {}).get("totals", {}).get("bytes_up", 0)
             for n, s in statuses.items() if n != "trainer")
    down = sum((s or {}).get("totals", {}).get("bytes_down", 0)
               for n, s in statuses.items() if n != "trainer")
    return up, down, (up / down if down else 0.0)


def render_live(cfg, metrics: list[dict], statuses: dict[str, dict | None], procs) -> Group:
    steps = _steps(metrics)
    warm = next((m for m in metrics if m.get("event") == "warmup"), None)
    last = steps[-1] if steps else {}
    head = Text()
    head.append(f"step {last.get('version', 0)}/{cfg.steps}   ", style="bold")
    if warm:
        head.append(f"warm-up reward {warm['after']['reward_mean']:.3f}   ")
    if steps:
        head.append(f"reward {last['reward_mean']:.3f}   ")
        head.append(f"delta {_kib(last['delta_bytes'])} vs full {_kib(last['dense_bytes'])} "
                    f"({last['dense_bytes'] / max(1, last['delta_bytes']):.0f}x)   ")
        head.append(f"staleness {last.get('staleness_hist')}")
    t = Table("node", "role", "current", "head", "lag", "down", "up", "peers", "spool",
              "engine", title="swarm", title_justify="left")
    for name, s in statuses.items():
        if s is None:
            t.add_row(name, "", "[dim]starting…[/]", "", "", "", "", "", "", "")
            continue
        cur, hd = s.get("current_version"), s.get("head_version")
        lag = "" if cur is None or hd is None else str(hd - cur)
        tot = s.get("totals", {})
        t.add_row(name, s.get("role", ""), str(cur), str(hd), lag, _kib(tot.get("bytes_down")),
                  _kib(tot.get("bytes_up")), str(len(s.get("peers", []))),
                  str(s.get("spool", {}).get("depth", "")),
                  str(s.get("engine", {}).get("last_version", "")))
    up, down, share = region_share(statuses)
    foot = Text(f"regions served each other {_kib(up)} of {_kib(down)} they fetched "
                f"({100 * share:.0f} %)   processes up: "
                f"{sum(p.alive() for p in procs.procs)}/{len(procs.procs)}")
    return Group(head, t, foot)


def publish_latencies(metrics: list[dict], seen: dict[tuple[str, int], float]) -> list[float]:
    """Seconds from the trainer publishing a version to the last region holding it."""
    regions = {r for r, _ in seen}
    out = []
    for m in _steps(metrics):
        v, t0 = m["version"], m.get("published_at")
        times = [seen.get((r, v)) for r in regions]
        if t0 and times and all(times):
            out.append(max(times) - t0)
    return out


def render_summary(cfg, metrics: list[dict], statuses: dict[str, dict | None],
                   seen: dict[tuple[str, int], float] | None = None) -> Table:
    steps = _steps(metrics)
    warm = next((m for m in metrics if m.get("event") == "warmup"), None)
    t = Table("measure", "value", title="demo summary", title_justify="left")
    if warm:
        t.add_row("reward before warm-up / after", f"{warm['before']['reward_mean']:.3f} / "
                  f"{warm['after']['reward_mean']:.3f}")
    if steps:
        k = max(1, len(steps) // 3)
        t.add_row(f"RL reward, first {k} steps → last {k}",
                  f"{statistics.mean(m['reward_mean'] for m in steps[:k]):.3f} → "
                  f"{statistics.mean(m['reward_mean'] for m in steps[-k:]):.3f}")
        deltas = [m["delta_bytes"] for m in steps]
        t.add_row("delta per version (median, max)",
                  f"{_kib(statistics.median(deltas))}, {_kib(max(deltas))}")
        t.add_row("full bf16 checkpoint", _kib(steps[-1]["dense_bytes"]))
        density = statistics.median(m["changed_elements"] / m["elements"] for m in steps)
        ratio = statistics.median(m["dense_bytes"] / max(1, m["delta_bytes"]) for m in steps)
        t.add_row("changed elements per version (median)", f"{100 * density:.2f} %")
        t.add_row("bytes per version vs full (median)", f"{ratio:.0f}x smaller")
    up, down, share = region_share(statuses)
    t.add_row("regions: bytes fetched / served to each other",
              f"{_kib(down)} / {_kib(up)} ({100 * share:.0f} %)")
    if seen:
        lat = publish_latencies(metrics, seen)
        if lat:
            t.add_row("publish → every region current (median, max)",
                      f"{statistics.median(lat):.1f} s, {max(lat):.1f} s")
    for name, s in statuses.items():
        if s:
            t.add_row(f"{name}: version, digest",
                      f"v{s.get('current_version')}  {str(s.get('state_digest'))[:16]}…")
    return t


def verdict(cfg, metrics: list[dict], statuses: dict[str, dict | None], out: Path
            ) -> tuple[bool, list[tuple[bool, str]]]:
    reasons: list[tuple[bool, str]] = []
    manifest = out / "trainer-daemon" / "chain" / "manifests" / f"v{cfg.steps:08d}.delta.json"
    digest = json.loads(manifest.read_text())["state_digest"] if manifest.exists() else None
    reasons.append((digest is not None, f"trainer published v{cfg.steps}"))
    for region in cfg.regions:
        s = statuses.get(region) or {}
        good = s.get("current_version") == cfg.steps and s.get("state_digest") == digest
        reasons.append((good, f"{region} is on v{s.get('current_version')} with "
                        f"{'the trainer' if good else 'a different'}'s state digest"))
    steps = _steps(metrics)
    if len(steps) >= 3 or (steps and cfg.min_reward_gain <= -1):
        k = max(1, len(steps) // 3)
        first = statistics.mean(m["reward_mean"] for m in steps[:k])
        last = statistics.mean(m["reward_mean"] for m in steps[-k:])
        gain = cfg.min_reward_gain
        reasons.append((last >= first + gain, f"reward {first:.3f} → {last:.3f} over the RL "
                        f"steps (needs {gain:+.2f})"))
    else:
        reasons.append((False, f"only {len(steps)} RL steps recorded"))
    return all(r[0] for r in reasons), reasons


def write_plot(metrics: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = _steps(metrics)
    v = [m["version"] for m in steps]
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    a.plot(v, [m["reward_mean"] for m in steps], marker="o")
    a.set_ylabel("mean reward")
    a.set_title("deltaswarm demo: reward and delta size per version")
    a.grid(alpha=0.3)
    b.bar(v, [m["delta_bytes"] / 1024 for m in steps], label="delta (KiB)")
    if steps:
        b.axhline(steps[-1]["dense_bytes"] / 1024, color="r", ls="--",
                  label="full bf16 checkpoint (KiB)")
    b.set_yscale("log")
    b.set_xlabel("version")
    b.set_ylabel("KiB")
    b.legend()
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
