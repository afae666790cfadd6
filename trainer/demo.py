"""`make demo` / `deltaswarm demo`: the whole system on one machine.

    deltaswarm demo --config configs/demo.yaml [--steps N] [--out DIR]

A trainer (GRPO + its daemon) and three regions (a daemon and a rollout worker each) run as
separate processes on loopback, state in a fresh directory. Each region bootstraps from the
peer before it, so heads and blocks travel peer to peer. A live view shows the run; at the end a
summary table and a PNG of reward and delta size per version. Exit 0 only if every region ends
on the final version with the trainer's state digest and the reward clearly rose. Ctrl-C stops
every process cleanly.
"""

import argparse
import json
import secrets
import signal
import sys
import time
import urllib.request
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

from trainer.procs import Procs


class RolloutSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompts_per_batch: int = Field(8, ge=1)
    group_size: int = Field(8, ge=2)
    max_tokens: int = Field(6, ge=1)


class DemoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    out_dir: Path = Path("runs")
    steps: int = Field(24, ge=2)
    regions: list[str] = Field(default=["us-east", "eu-west", "ap-south"], min_length=1)
    base_port: int = Field(17600, ge=1024, le=60000)
    trainer_upload_bytes_per_s: int = Field(0, ge=0)
    task: str = "rollout.tasks.arithmetic"
    model: dict = {}
    warmup: dict = {}
    grpo: dict = {}
    batch: int = Field(96, ge=1)
    rollout: RolloutSection = RolloutSection()
    snapshot_every: int = Field(8, ge=1)
    timeout_s: float = Field(900, gt=0)
    min_reward_gain: float = 0.05
    """The run passes only if the mean reward of the last third of the steps beats the first
    third by this much."""


def load_demo_config(path: Path) -> DemoConfig:
    doc = yaml.safe_load(Path(path).read_text()) or {}
    cfg = DemoConfig.model_validate(doc)
    if not cfg.out_dir.is_absolute():
        cfg.out_dir = (Path(path).parent / cfg.out_dir).resolve()
    return cfg


def write_configs(cfg: DemoConfig, out: Path) -> dict:
    """Key, token and one YAML per process; returns the layout the run needs."""
    from chain import keys

    key = keys.generate(out / "trainer.key")
    token = secrets.token_hex(16)
    port = cfg.base_port
    trainer_http = f"http://127.0.0.1:{port}"
    ingest = f"http://127.0.0.1:{port + 2}/v1/ingest"
    nodes = {}
    (out / "trainer-daemon").mkdir()
    nodes["trainer"] = {
        "node": "trainer", "region": "trainer", "role": "trainer",
        "state_dir": str(out / "trainer-daemon"),
        "http": {"host": "127.0.0.1", "port": port},
        "bittorrent": {"host": "127.0.0.1", "port": port + 1, "piece_size": 65536},
        "trainer_public_key": keys.public_hex(key), "token": token, "seed_mode": True,
        "limits": {"upload_bytes_per_s": cfg.trainer_upload_bytes_per_s},
        "trajectories": {"upstream": ingest},
    }
    prev = trainer_http
    for i, region in enumerate(cfg.regions):
        rport = port + 10 * (i + 1)
        (out / region).mkdir()
        nodes[region] = {
            "node": f"{region}-1", "region": region, "role": "region",
            "state_dir": str(out / region),
            "http": {"host": "127.0.0.1", "port": rport},
            "bittorrent": {"host": "127.0.0.1", "port": rport + 1, "piece_size": 65536},
            "bootstrap": [prev], "trainer_public_key": keys.public_hex(key), "token": token,
            "trajectories": {"upstream": f"{trainer_http}/v1/trajectories"},
            "long_poll_timeout_s": 10,
        }
        prev = f"http://127.0.0.1:{rport}"
    for name, doc in nodes.items():
        (out / f"{name}.daemon.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    trainer_cfg = {
        "run": f"demo-{out.name}", "state_dir": str(out / "trainer"),
        "chain_dir": str(out / "trainer-daemon" / "chain"), "key": str(out / "trainer.key"),
        "daemon": {"url": trainer_http, "token": token},
        "ingest": {"host": "127.0.0.1", "port": port + 2, "token": token},
        "model": cfg.model, "task": cfg.task, "warmup": cfg.warmup, "grpo": cfg.grpo,
        "steps": cfg.steps, "batch": cfg.batch, "snapshot_every": cfg.snapshot_every,
        "wait_timeout_s": 300, "block_size": 1 << 20,
    }
    (out / "trainer.yaml").write_text(yaml.safe_dump(trainer_cfg, sort_keys=False))
    return {"token": token, "urls": {n: f"http://127.0.0.1:{d['http']['port']}"
                                     for n, d in nodes.items()}}


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

    from trainer.demo_view import render_live, render_summary, verdict, write_plot

    console = Console()
    out.mkdir(parents=True)
    layout = write_configs(cfg, out)
    token, urls = layout["token"], layout["urls"]
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
    try:
        procs.start("trainer-daemon", "daemon.main", "--config", str(out / "trainer.daemon.yaml"))
        trainer = procs.start("trainer", "trainer.main", "--config", str(out / "trainer.yaml"))
        for i, region in enumerate(cfg.regions):
            procs.start(f"{region}-daemon", "daemon.main", "--config",
                        str(out / f"{region}.daemon.yaml"))
            procs.start(
                f"{region}-worker", "rollout.worker", "--daemon", urls[region], "--token", token,
                "--task", cfg.task, "--region", region,
                "--prompts-per-batch", str(cfg.rollout.prompts_per_batch),
                "--group-size", str(cfg.rollout.group_size),
                "--max-tokens", str(cfg.rollout.max_tokens), "--threads", "1",
                "--seed", str(i),
            )
        metrics_path = out / "trainer" / "metrics.jsonl"
        deadline = time.monotonic() + cfg.timeout_s
        final_seen_at = None
        seen: dict[tuple[str, int], float] = {}
        with Live(console=console, refresh_per_second=2, transient=False) as live:
            while not stop["asked"] and time.monotonic() < deadline:
                statuses = {n: fetch_status(u, token) for n, u in urls.items()}
                now = time.time()
                for r in cfg.regions:
                    cur = (statuses.get(r) or {}).get("current_version")
                    if cur is not None:
                        seen.setdefault((r, cur), now)
                metrics = read_metrics(metrics_path)
                live.update(render_live(cfg, metrics, statuses, procs))
                dead = [p for p in procs.procs if not p.alive() and p is not trainer]
                if dead or (not trainer.alive() and trainer.popen.returncode != 0):
                    bad = dead[0] if dead else trainer
                    console.print(f"[red]{bad.name} exited ({bad.popen.returncode}); last log "
                                  f"lines:[/]\n{bad.tail()}")
                    break
                done = any(m.get("event") == "done" for m in metrics)
                regions_at = [(statuses.get(r) or {}).get("current_version")
                              for r in cfg.regions]
                if done and all(v == cfg.steps for v in regions_at):
                    final_seen_at = final_seen_at or time.monotonic()
                    if time.monotonic() - final_seen_at > 2:
                        break
                time.sleep(0.5)
        metrics = read_metrics(metrics_path)
        statuses = {n: fetch_status(u, token) for n, u in urls.items()}
        ok, reasons = verdict(cfg, metrics, statuses, out)
        console.print(render_summary(cfg, metrics, statuses, seen))
        png = write_plot(metrics, out / "demo.png")
        console.print(f"plot: {png}")
        for r in reasons:
            console.print(("[green]✓[/] " if r[0] else "[red]✗[/] ") + r[1])
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; stopping every process[/]")
    finally:
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
    p.add_argument("--min-reward-gain", type=float, help="override the reward check")
    a = p.parse_args(argv)
    cfg = load_demo_config(a.config)
    if a.steps:
        cfg.steps = a.steps
    if a.warmup_steps is not None:
        cfg.warmup = {**cfg.warmup, "steps": a.warmup_steps}
    if a.min_reward_gain is not None:
        cfg.min_reward_gain = a.min_reward_gain
    out = a.out or cfg.out_dir / time.strftime("demo-%Y%m%d-%H%M%S")
    return run(cfg, out.resolve())


if __name__ == "__main__":
    sys.exit(main())
