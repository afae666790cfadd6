"""What the demo shows: the live table, the closing summary, the verdict and the PNG."""

import json
import statistics
from pathlib import Path

from rich.console import Group
from rich.table import Table
from rich.text import Text

from demo.heldout import Score

# The realistic case, measured by `make bench` (bench/codec.py: an 18.9 M-parameter Qwen2
# trained like an RL policy at lr 1e-6, bf16 published per step; see docs/MEASURED.md).
BENCH_CASE = "codec bench, realistic RL (lr 1e-6): 1.2-1.6 % changed, 150-195x smaller"
BENCH_RATIO = 170  # middle of the bench's 150-195x, drawn as a reference line in the PNG


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


def stale_share(metrics: list[dict]) -> tuple[int, int]:
    """(trajectories dropped as stale, trajectories the trainer received) over all steps."""
    rec = [m for m in metrics if m.get("event") in ("step", "skip")]
    return sum(m.get("dropped_stale", 0) for m in rec), sum(m.get("received", 0) for m in rec)


def density(steps: list[dict]) -> float:
    """Median fraction of bf16 elements changed per version."""
    return statistics.median(m["changed_elements"] / m["elements"] for m in steps)


def size_ratio(steps: list[dict]) -> float:
    """Median of full bf16 tensor bytes / delta tensor bytes per version: on tensors, since
    the carried files (config, tokenizer) every version lists are, unchanged, blocks no region
    fetches again; counted in, they made deltas whose tensors were 154-231x smaller look 45x
    smaller (issue 22)."""
    return statistics.median(m["dense_bytes"] / max(1, m["delta_tensor_bytes"]) for m in steps)


def render_live(cfg, metrics: list[dict], statuses: dict[str, dict | None], procs,
                scores: list[Score] = ()) -> Group:
    steps = _steps(metrics)
    last = steps[-1] if steps else {}
    head = Text()
    head.append(f"step {last.get('version', 0)}/{cfg.steps}   ", style="bold")
    if scores:
        head.append(f"held-out reward {scores[0].sampled:.3f} (v0) → {scores[-1].sampled:.3f} "
                    f"(v{scores[-1].version})   ")
    if steps:
        head.append(f"batch reward {last['reward_mean']:.3f}   ")
        head.append(f"delta {_kib(last['delta_tensor_bytes'])} tensors (+ "
                    f"{_kib(last['delta_file_bytes'])} carried files) vs full "
                    f"{_kib(last['dense_bytes'])} "
                    f"({100 * last['changed_elements'] / last['elements']:.1f} % changed)   ")
        dropped, received = stale_share(metrics)
        head.append(f"stale {dropped}/{received}")
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


def publish_latencies(metrics: list[dict], seen: dict[tuple[str, int], float]
                      ) -> dict[str, list[tuple[int, float]]]:
    """Per region: (version, seconds from the trainer publishing it to the region serving it)
    for every version the demo saw the region current on (polled twice a second)."""
    out: dict[str, list[tuple[int, float]]] = {r: [] for r, _ in seen}
    for m in _steps(metrics):
        v, t0 = m["version"], m.get("published_at")
        for r in out:
            t = seen.get((r, v))
            if t0 and t:
                out[r].append((v, max(0.0, t - t0)))
    return out


def render_summary(cfg, metrics: list[dict], statuses: dict[str, dict | None],
                   seen: dict[tuple[str, int], float] | None = None,
                   scores: list[Score] = (), wall_s: float | None = None) -> Table:
    steps = _steps(metrics)
    warm = next((m for m in metrics if m.get("event") == "warmup"), None)
    t = Table("measure", "value", title="demo summary", title_justify="left")
    if scores:
        a, b = scores[0], scores[-1]
        t.add_row(f"held-out reward, {cfg.heldout.prompts} fixed prompts x "
                  f"{cfg.heldout.samples} samples: v{a.version} → v{b.version}",
                  f"{a.sampled:.3f} → {b.sampled:.3f} ({b.sampled - a.sampled:+.3f})")
        t.add_row("  same prompts, greedy (solved)",
                  f"{a.greedy:.3f} ({100 * a.solved:.0f} %) → {b.greedy:.3f} "
                  f"({100 * b.solved:.0f} %)")
    if warm:
        t.add_row("warm-up (sampled reward before / after)",
                  f"{warm['before']['reward_mean']:.3f} / {warm['after']['reward_mean']:.3f}")
    if steps:
        k = max(1, len(steps) // 3)
        t.add_row(f"batch reward, first {k} steps → last {k} (other prompts each step)",
                  f"{statistics.mean(m['reward_mean'] for m in steps[:k]):.3f} → "
                  f"{statistics.mean(m['reward_mean'] for m in steps[-k:]):.3f}")
        deltas = [m["delta_tensor_bytes"] for m in steps]
        t.add_row("delta tensors per version (median, max) / full bf16 checkpoint's tensors",
                  f"{_kib(statistics.median(deltas))}, {_kib(max(deltas))} / "
                  f"{_kib(steps[-1]['dense_bytes'])}")
        t.add_row("  + carried files (config, tokenizer) each version lists (median)",
                  f"{_kib(statistics.median(m['delta_file_bytes'] for m in steps))} (unchanged "
                  "ones are blocks a region holds, not fetched again)")
        t.add_row("this demo: changed elements per version, tensors vs full (medians)",
                  f"{100 * density(steps):.1f} % changed, {size_ratio(steps):.0f}x smaller")
        t.add_row("  for scale (not this run)", BENCH_CASE)
    dropped, received = stale_share(metrics)
    if received:
        t.add_row("trajectories dropped as stale",
                  f"{dropped} of {received} ({100 * dropped / received:.1f} %)")
    up, down, share = region_share(statuses)
    t.add_row("regions: bytes fetched / served to each other",
              f"{_kib(down)} / {_kib(up)} ({100 * share:.0f} %)")
    lats = publish_latencies(metrics, seen or {})
    for region in cfg.regions:
        lat = lats.get(region)
        if lat:
            s = [x for _, x in lat]
            t.add_row(f"publish → {region} current (median, max)",
                      f"{statistics.median(s):.1f} s, {max(s):.1f} s")
    for name, s in statuses.items():
        if s:
            t.add_row(f"{name}: version, digest",
                      f"v{s.get('current_version')}  {str(s.get('state_digest'))[:16]}…")
    if wall_s is not None:
        t.add_row("wall time", f"{wall_s:.0f} s")
    return t


def verdict(cfg, metrics: list[dict], statuses: dict[str, dict | None], out: Path,
            scores: list[Score] = ()) -> tuple[bool, list[tuple[bool, str]]]:
    reasons: list[tuple[bool, str]] = []
    manifest = out / "trainer-daemon" / "chain" / "manifests" / f"v{cfg.steps:08d}.delta.json"
    digest = json.loads(manifest.read_text())["state_digest"] if manifest.exists() else None
    reasons.append((digest is not None, f"trainer published v{cfg.steps}"))
    for region in cfg.regions:
        s = statuses.get(region) or {}
        good = s.get("current_version") == cfg.steps and s.get("state_digest") == digest
        reasons.append((good, f"{region} is on v{s.get('current_version')} with "
                        f"{'the trainer' if good else 'a different'}'s state digest"))
    gain = cfg.min_reward_gain
    if gain <= -1:
        return all(r[0] for r in reasons), reasons
    first = next((x for x in scores if x.version == 0), None)
    last = next((x for x in scores if x.version == cfg.steps), None)
    if first is None or last is None:
        missing = " and ".join(f"v{v}" for v, x in ((0, first), (cfg.steps, last)) if x is None)
        reasons.append((False, f"held-out set not scored on {missing}"))
    else:
        reasons.append((last.sampled >= first.sampled + gain,
                        f"held-out reward {first.sampled:.3f} → {last.sampled:.3f} from v0 "
                        f"to v{cfg.steps} (needs {gain:+.2f})"))
    return all(r[0] for r in reasons), reasons


def write_plot(cfg, metrics: list[dict], statuses: dict[str, dict | None],
               seen: dict[tuple[str, int], float], scores: list[Score], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = _steps(metrics)
    v = [m["version"] for m in steps]
    fig, ((a, b), (c, d)) = plt.subplots(2, 2, figsize=(12, 8))
    if scores:
        sv = [x.version for x in scores]
        a.plot(sv, [x.sampled for x in scores], marker="o", lw=2,
               label=f"held-out, {cfg.heldout.samples} samples/prompt")
        a.plot(sv, [x.greedy for x in scores], marker="s", ls="--", label="held-out, greedy")
    a.plot(v, [m["reward_mean"] for m in steps], color="grey", alpha=0.4, lw=1,
           label="training batch (other prompts each step)")
    a.set(title=f"reward on {cfg.heldout.prompts} fixed held-out prompts", xlabel="version",
          ylabel="mean reward")
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    if steps:
        full = steps[-1]["dense_bytes"] / 1024
        b.bar(v, [m["delta_tensor_bytes"] / 1024 for m in steps],
              label="delta tensors (this demo; carried files not counted)")
        b.axhline(full, color="r", ls="--", label="full bf16 checkpoint")
        b.axhline(full / BENCH_RATIO, color="g", ls=":",
                  label=f"full / {BENCH_RATIO} (codec bench's ratio at ~1.4 % changed)")
        b.set_yscale("log")
        b.set_title(f"tensor bytes per version: {100 * density(steps):.1f} % of elements "
                    f"changed, {size_ratio(steps):.0f}x smaller\n(codec bench at ~1.4 % changed: "
                    "150-195x)", fontsize=9)
    b.set(xlabel="version", ylabel="KiB (log)")
    b.legend(fontsize=8)
    b.grid(alpha=0.3, which="both")
    lats = publish_latencies(metrics, seen)
    for region in cfg.regions:
        lat = lats.get(region)
        if lat:
            c.plot([x for x, _ in lat], [y for _, y in lat], marker=".", label=region)
    c.set(title="publish → region serving the version", xlabel="version", ylabel="seconds")
    c.legend(fontsize=8)
    c.grid(alpha=0.3)
    names = list(cfg.regions)
    tot = [(statuses.get(n) or {}).get("totals", {}) for n in names]
    x = range(len(names))
    d.bar([i - 0.2 for i in x], [t.get("bytes_down", 0) / 1e6 for t in tot], 0.4,
          label="fetched")
    d.bar([i + 0.2 for i in x], [t.get("bytes_up", 0) / 1e6 for t in tot], 0.4,
          label="served to other regions")
    trainer_up = ((statuses.get("trainer") or {}).get("totals", {}).get("bytes_up", 0)) / 1e6
    d.set_xticks(list(x), names)
    d.set(title=f"bytes per region (trainer uploaded {trainer_up:.1f} MB)", ylabel="MB")
    d.legend(fontsize=8)
    d.grid(alpha=0.3, axis="y")
    fig.suptitle("deltaswarm demo")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
