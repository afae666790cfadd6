"""The demo's configuration, and the typed configs it builds for every process it starts.

The demo sits above the three runtime packages (it starts a daemon, a trainer and rollout
workers), so it is the one place that imports all their config models: each process's YAML is
written from a validated object (`to_yaml`), never from a hand-built dict, so a misspelt field
fails here, before any process starts.
"""

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import Field, model_validator

from chain.config_base import NAME_PATTERN, Section, load_yaml, replace, to_yaml
from daemon.config import BtListen, Config, HttpListen, Limits, Trajectories
from rollout.config import WorkerConfig
from trainer.config import (
    DaemonLink,
    GRPOSection,
    IngestConfig,
    ModelConfig,
    TrainerConfig,
    WarmupConfig,
)

PIECE_SIZE = 65536  # small pieces: the demo's model is small and the swarm should still split it


class RolloutSection(Section):
    prompts_per_batch: int = Field(8, ge=1, le=4096)
    """Prompts each region's worker samples per batch."""
    group_size: int = Field(8, ge=2, le=256)
    """Completions per prompt (one GRPO group; at least 2 for a group baseline)."""
    max_tokens: int = Field(6, ge=1, le=32768)
    """Most tokens per completion."""


class HeldOutSection(Section):
    prompts: int = Field(400, ge=1, le=100_000)
    """Problems scored, drawn once with `seed` from the task's held-out split (problems the
    warm-up and the workers never sample); all of them if the split has fewer."""
    samples: int = Field(4, ge=1, le=256)
    """Completions per prompt for the score at the sampling temperature (shown, not checked)."""
    seed: int = Field(1234, ge=0, le=2**63 - 1)
    """Seed of the problem draw and of the sampling generator: the same set every run."""
    every: int = Field(5, ge=1, le=100_000)
    """Score every this many versions during RL (v0 and the last version always)."""


class DemoConfig(Section):
    out_dir: Path = Path("runs")
    """Where each run's directory (demo-<time>) is created; relative to this file."""
    steps: int = Field(24, ge=2, le=100_000)
    """Versions the trainer publishes after v0."""
    regions: list[Annotated[str, Field(pattern=NAME_PATTERN)]] = Field(
        ["us-east", "eu-west", "ap-south"], min_length=1, max_length=16)
    """Region names; each bootstraps from the one before it (the first from the trainer)."""
    base_port: int = Field(17600, ge=1024, le=60000)
    """Trainer daemon http = base, bt = base+1, ingest = base+2; region i uses base+10*(i+1)."""
    trainer_upload_bytes_per_s: int = Field(0, ge=0, le=1 << 40)
    """Upload cap of the trainer's daemon (0 = none); a thin uplink makes regions share."""
    task: str = Field("rollout.tasks.arithmetic_digits", min_length=1, max_length=1024)
    """Task plug-in spec for trainer and workers; it needs a held-out split
    (`heldout_prompts()`), which the demo's success check is scored on."""
    model: ModelConfig = ModelConfig()
    """The trainer's model section."""
    warmup: WarmupConfig = WarmupConfig()
    """The trainer's warm-up section."""
    grpo: GRPOSection = GRPOSection()
    """The trainer's GRPO section."""
    batch: int = Field(96, ge=1, le=1_000_000)
    """Trajectories per optimizer step (whole groups)."""
    rollout: RolloutSection = RolloutSection()
    """The workers' batch shape."""
    pace_ahead: int | None = Field(1, ge=0, le=1000)
    """Workers generate their share of each version's batch (batch / regions) plus this many
    versions ahead, then wait for a newer version (null: unpaced, they outrun the trainer)."""
    heldout: HeldOutSection = HeldOutSection()
    """The held-out problems the run is judged on (the task's split, never trained on)."""
    snapshot_every: int = Field(8, ge=1, le=1_000_000)
    """A full snapshot every this many versions."""
    timeout_s: float = Field(900, gt=0, le=86400)
    """The whole demo fails if it takes longer."""
    min_reward_gain: float = Field(0.03, ge=-1, le=1)
    """The run passes only if the greedy reward on the held-out problems of the last version
    beats v0's by this much (-1 turns the check off)."""

    @model_validator(mode="after")
    def _ports_fit(self) -> "DemoConfig":
        if self.base_port + 10 * len(self.regions) + 1 > 65535:
            raise ValueError(f"base_port {self.base_port} leaves no room for "
                             f"{len(self.regions)} regions (10 ports each)")
        if len(set(self.regions)) != len(self.regions) or "trainer" in self.regions:
            raise ValueError("region names must be unique and not `trainer`")
        return self


def load_demo_config(path: str | os.PathLike) -> DemoConfig:
    return load_yaml(DemoConfig, path, paths=("out_dir",))


def with_overrides(cfg: DemoConfig, **changes: object) -> DemoConfig:
    """`cfg` with fields changed and re-validated (see chain.config_base.replace)."""
    return replace(cfg, **changes)


@dataclass(frozen=True)
class Layout:
    """Every process's config as an object, plus where the demo reaches each daemon."""

    token: str
    daemons: dict[str, Config]
    trainer: TrainerConfig
    workers: dict[str, WorkerConfig]

    def urls(self) -> dict[str, str]:
        return {name: d.http.url() for name, d in self.daemons.items()}


def build_layout(cfg: DemoConfig, out: Path, public_key_hex: str, token: str | None = None
                 ) -> Layout:
    """The configs of the trainer's daemon, the trainer, and each region's daemon and worker,
    with state under `out`."""
    token = token or secrets.token_hex(16)
    port = cfg.base_port
    trainer_http = f"http://127.0.0.1:{port}"
    common = {"trainer_public_key": public_key_hex, "token": token}
    daemons = {"trainer": Config(
        node="trainer", region="trainer", role="trainer", state_dir=out / "trainer-daemon",
        http=HttpListen(host="127.0.0.1", port=port),
        bittorrent=BtListen(host="127.0.0.1", port=port + 1, piece_size=PIECE_SIZE),
        seed_mode=True, limits=Limits(upload_bytes_per_s=cfg.trainer_upload_bytes_per_s),
        trajectories=Trajectories(upstream=f"http://127.0.0.1:{port + 2}/v1/ingest"), **common)}
    workers = {}
    prev = trainer_http
    for i, region in enumerate(cfg.regions):
        rport = port + 10 * (i + 1)
        daemons[region] = Config(
            node=f"{region}-1", region=region, role="region", state_dir=out / region,
            http=HttpListen(host="127.0.0.1", port=rport),
            bittorrent=BtListen(host="127.0.0.1", port=rport + 1, piece_size=PIECE_SIZE),
            bootstrap=[prev], trajectories=Trajectories(upstream=f"{trainer_http}/v1/trajectories"),
            long_poll_timeout_s=10, **common)
        pace = {} if cfg.pace_ahead is None else {
            "pace_per_version": -(-cfg.batch // len(cfg.regions)), "pace_ahead": cfg.pace_ahead}
        workers[region] = WorkerConfig(
            daemon=daemons[region].http.url(), token=token, task=cfg.task, region=region,
            worker=f"{region}-worker", seed=i, temperature=cfg.grpo.temperature,
            **cfg.rollout.model_dump(), **pace)
        prev = daemons[region].http.url()
    trainer = TrainerConfig(
        run=f"demo-{out.name}", state_dir=out / "trainer",
        chain_dir=out / "trainer-daemon" / "chain", key=out / "trainer.key",
        daemon=DaemonLink(url=trainer_http, token=token),
        ingest=IngestConfig(host="127.0.0.1", port=port + 2, token=token),
        model=cfg.model, task=cfg.task, warmup=cfg.warmup, grpo=cfg.grpo, steps=cfg.steps,
        batch=cfg.batch, snapshot_every=cfg.snapshot_every, wait_timeout_s=300,
        block_size=1 << 20)
    return Layout(token=token, daemons=daemons, trainer=trainer, workers=workers)


def write_layout(layout: Layout, out: Path) -> dict[str, Path]:
    """Each process's YAML under `out` (state directories created); process name -> its file."""
    texts = {**{f"{n}-daemon": to_yaml(d) for n, d in layout.daemons.items()},
             **{f"{n}-worker": to_yaml(w) for n, w in layout.workers.items()},
             "trainer": to_yaml(layout.trainer)}
    for d in layout.daemons.values():
        d.state_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, text in texts.items():
        paths[name] = out / f"{name}.yaml"
        paths[name].write_text(text)
    return paths
