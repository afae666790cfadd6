"""The reference trainer's configuration: one pydantic tree loaded from YAML.

Paths are resolved against the config file's directory, so a run directory is relocatable.
"""

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    path: Path | None = None
    """An HF causal-LM directory to train; null builds the embedded default model."""
    seed: int = 0
    """Seed of the default model's initialisation and of the warm-up."""
    hidden: int = Field(128, ge=16, le=8192)
    layers: int = Field(2, ge=1, le=128)
    heads: int = Field(4, ge=1, le=128)


class WarmupConfig(_Section):
    steps: int = Field(200, ge=0, le=100_000)
    """Supervised steps on task references before RL (0 skips)."""
    lr: float = Field(3e-3, gt=0, le=1)
    batch: int = Field(64, ge=1, le=4096)


class GRPOSection(_Section):
    lr: float = Field(1e-4, gt=0, le=1)
    """AdamW learning rate on the fp32 master weights."""
    adam_eps: float = Field(1e-4, gt=0, le=1)
    """AdamW epsilon; larger than torch's 1e-8 so near-zero gradients do not move every weight
    by a full lr step (which would change far more bf16 values per version)."""
    is_cap: float = Field(2.0, ge=1)
    """Truncated importance sampling cap."""
    max_staleness: int = Field(4, ge=0, le=1000)
    """Trajectories more than this many versions behind the trainer are dropped."""
    grad_clip: float = Field(1.0, gt=0)
    temperature: float = Field(1.0, gt=0)
    """Must equal the rollout workers' sampling temperature."""


class DaemonLink(_Section):
    url: str | None = None
    """The local daemon's control plane; null publishes to the chain dir only."""
    token: str | None = None


class IngestConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8800, ge=1, le=65535)
    token: str = Field(min_length=8)
    """Bearer token the daemons' forwarders present."""


class TrainerConfig(_Section):
    run: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    """Run name, stamped into every manifest; daemons refuse other runs."""
    state_dir: Path
    """Trainer checkpoints, ingest store and metrics."""
    chain_dir: Path
    """The local daemon's chain directory (`<daemon state_dir>/chain`)."""
    key: Path
    """Ed25519 signing key (created by `deltaswarm keygen` or on first start)."""
    daemon: DaemonLink = DaemonLink()
    ingest: IngestConfig
    model: ModelConfig = ModelConfig()
    task: str = "rollout.tasks.arithmetic"
    """Task plug-in spec (see rollout/tasks/__init__.py)."""
    warmup: WarmupConfig = WarmupConfig()
    grpo: GRPOSection = GRPOSection()
    steps: int = Field(30, ge=1, le=10_000_000)
    """Versions to publish after v0."""
    batch: int = Field(64, ge=1, le=1_000_000)
    """Trajectories per optimizer step (whole groups)."""
    wait_timeout_s: float = Field(600, gt=0)
    """Give up if no trajectory arrives for this long."""
    snapshot_every: int = Field(10, ge=1)
    retention_versions: int = Field(16, ge=1)
    block_size: int = Field(4 << 20, ge=1 << 16, le=64 << 20)
    on_exit: Literal["stop", "serve"] = "stop"
    """After the last step: exit, or keep the ingest endpoint up."""


class TrainerConfigError(ValueError):
    pass


def load_trainer_config(path: Path) -> TrainerConfig:
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise TrainerConfigError(f"{path}: cannot read config: {e}") from None
    if not isinstance(doc, dict):
        raise TrainerConfigError(f"{path}: expected a mapping at the top level")
    for key in ("state_dir", "chain_dir", "key"):
        if key in doc and not Path(str(doc[key])).is_absolute():
            doc[key] = str(path.parent / str(doc[key]))
    try:
        return TrainerConfig.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise TrainerConfigError(f"{path}: field {where}: {err['msg']}") from None
