"""`make demo` / `deltaswarm demo`: the whole system on one machine.

    deltaswarm demo --config configs/demo.yaml [--steps N] [--out DIR]

A trainer (GRPO + its daemon) and three regions (a daemon and a rollout worker each) run as
separate processes on loopback, state in a fresh directory. Each region bootstraps from the
peer before it, so heads and blocks travel peer to peer. Workers pace themselves to the trainer
(their share of each version's batch, one version ahead), so none of their trajectories go
stale. A thread scores problems of the task's held-out split (never sampled by the warm-up or
the workers) on the first region's weights at v0, during RL and at the last version. A live
view shows the run; at the end a summary table and a PNG (held-out reward, bytes per version
against the full checkpoint, publish-to-current time per region, bytes the regions served each
other). Exit 0 only if every region ends on the final version with the trainer's state digest,
no trajectory the trainer received was a held-out problem, and the greedy reward on the
held-out problems rose by `min_reward_gain` from v0 to the last version (demo/verdict.py).
Ctrl-C stops every process cleanly.
"""

import argparse
import json
import signal
import sys
import time
import urllib.request
from pathlib import Path

from chain.config_base import ConfigError
from demo.config import DemoConfig, build_layout, load_demo_config, with_overrides, write_layout
from demo.procs import Procs


def fetch_status(url: str, token: str) -> dict | None:
    req = urllib.request.Request(f"{url}/v1/status",
                                 headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def read_metrics(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def run(cfg: DemoConfig, out: Path) -> int:
    from rich.console import Console
    from rich.live import Live

    from chain import keys
    from demo.heldout import Evaluator, HeldOut, NoHeldOutSplit, heldout_set
    from demo.verdict import summary_rows, verdict
    from demo.view import render_live, render_summary, write_plot
    from rollout.tasks import TaskSpecError, load_task

    console = Console()
    try:  # before any process starts: the success check needs the task's held-out split
        split = set(heldout_set(load_task(cfg.task), 1 << 30, 0))
    except (NoHeldOutSplit, TaskSpecError) as e:
        console.print(f"[red]deltaswarm demo: {e}[/]")
        return 2
    out.mkdir(parents=True)
    key = keys.generate(out / "trainer.key")
    layout = build_layout(cfg, out, keys.public_hex(key))
    paths = write_layout(layout, out)
    token, urls = layout.token, layout.urls()
    procs = Procs(out / "logs")
    stop = {"asked": False}

    def on_signal(signum: int, _frame: object) -> None:
        if stop["asked"]:
            raise KeyboardInterrupt
        stop["asked"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    console.print(f"[bold]deltaswarm demo[/] — state in {out}")
    statuses: dict[str, dict | None] = {}
    ok = False
    h = cfg.heldout
    evaluator = Evaluator(
        lambda: HeldOut(cfg.task, h.prompts, h.samples, h.seed, cfg.rollout.max_tokens,
                        cfg.grpo.temperature),
        urls[cfg.regions[0]], token, h.every, cfg.steps)
    started = time.monotonic()
    try:
        evaluator.start()  # first, so its torch import overlaps the processes' start-up
        procs.start("trainer-daemon", "daemon.main", "--config", str(paths["trainer-daemon"]))
        # One torch thread: eight processes share the machine's cores, and a second intra-op
        # thread only spins against the workers' generation.
        trainer = procs.start("trainer", "trainer.main", "--config", str(paths["trainer"]),
                              env={"OMP_NUM_THREADS": "1"})
        for region in cfg.regions:
            procs.start(f"{region}-daemon", "daemon.main", "--config",
                        str(paths[f"{region}-daemon"]))
        workers_started = False
        metrics_path = out / "trainer" / "metrics.jsonl"
        deadline = time.monotonic() + cfg.timeout_s
        final_seen_at = None
        seen: dict[tuple[str, int], float] = {}
        with Live(console=console, refresh_per_second=2, transient=False) as live:
            while not stop["asked"] and time.monotonic() < deadline:
                # Workers start once v0 is scored: "before RL" is then exactly v0, however fast
                # the first versions follow (a region keeps only its last two weight dirs).
                if not workers_started and (evaluator.scores or not evaluator.is_alive()
                                            or time.monotonic() - started > 120):
                    for region in cfg.regions:
                        procs.start(f"{region}-worker", "rollout.worker", "--config",
                                    str(paths[f"{region}-worker"]), "--threads", "1")
                    workers_started = True
                statuses = {n: fetch_status(u, token) for n, u in urls.items()}
                now = time.time()
                for r in cfg.regions:
                    cur = (statuses.get(r) or {}).get("current_version")
                    if cur is not None:
                        seen.setdefault((r, cur), now)
                metrics = read_metrics(metrics_path)
                live.update(render_live(cfg, metrics, statuses, procs, evaluator.scores))
                dead = [p for p in procs.procs if not p.alive() and p is not trainer]
                if dead or (not trainer.alive() and trainer.popen.returncode != 0):
                    bad = dead[0] if dead else trainer
                    console.print(f"[red]{bad.name} exited ({bad.popen.returncode}); last log "
                                  f"lines:[/]\n{bad.tail()}")
                    break
                done = any(m.get("event") == "done" for m in metrics)
                regions_at = [(statuses.get(r) or {}).get("current_version")
                              for r in cfg.regions]
                scored = bool(evaluator.scores) and evaluator.scores[-1].version >= cfg.steps
                if done and all(v == cfg.steps for v in regions_at) and (
                        scored or not evaluator.is_alive()):
                    final_seen_at = final_seen_at or time.monotonic()
                    if time.monotonic() - final_seen_at > 2:
                        break
                time.sleep(0.5)
        metrics = read_metrics(metrics_path)
        statuses = {n: fetch_status(u, token) for n, u in urls.items()}
        evaluator.stop()
        scores = list(evaluator.scores)
        wall = time.monotonic() - started
        (out / "heldout.json").write_text(json.dumps(
            {"prompts": evaluator.prompts, "split_size": len(split),
             "scores": [x.as_dict() for x in scores], "error": evaluator.error}, indent=1))
        scored = len(evaluator.prompts)
        ok, reasons = verdict(cfg, metrics, statuses, out, scores, split, scored)
        summary = render_summary(cfg, metrics, statuses, seen, scores, wall)
        for row in summary_rows(cfg, scores, scored, len(split)):
            summary.add_row(*row)
        console.print(summary)
        png = write_plot(cfg, metrics, statuses, seen, scores, out / "demo.png")
        console.print(f"plot: {png}")
        for r in reasons:
            console.print(("[green]✓[/] " if r[0] else "[red]✗[/] ") + r[1])
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; stopping every process[/]")
    finally:
        evaluator.stop()
        procs.stop_all()
    if stop["asked"]:
        console.print("[yellow]stopped by signal[/]")
        return 130
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deltaswarm demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=Path("configs/demo.yaml"))
    p.add_argument("--steps", type=int, help="override the number of versions")
    p.add_argument("--out", type=Path, help="run directory (default: out_dir/demo-<time>)")
    p.add_argument("--warmup-steps", type=int, help="override warm-up steps")
    p.add_argument("--min-reward-gain", type=float, help="override the greedy held-out check")
    a = p.parse_args(argv)
    changes: dict[str, object] = {}
    if a.steps:
        changes["steps"] = a.steps
    if a.min_reward_gain is not None:
        changes["min_reward_gain"] = a.min_reward_gain
    try:
        cfg = load_demo_config(a.config)
        if a.warmup_steps is not None:
            changes["warmup"] = {"steps": a.warmup_steps}
        cfg = with_overrides(cfg, **changes)
    except ConfigError as e:
        print(f"deltaswarm demo: {e}", file=sys.stderr)
        return 2
    out = a.out or cfg.out_dir / time.strftime("demo-%Y%m%d-%H%M%S")
    return run(cfg, out.resolve())


if __name__ == "__main__":
    sys.exit(main())
