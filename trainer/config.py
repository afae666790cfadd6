"""The reference trainer's configuration: one pydantic tree loaded from YAML, in the style every
process shares (chain/config_base.py): each field documented and bounded, every bad field named
at once with the file. Paths are resolved against the config file's directory, so a run
directory is relocatable.

    deltaswarm train --config configs/train.yaml
"""

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from chain.config_base import NAME_PATTERN, ConfigError, Section, load_yaml

# The trainer's entry point catches this name; it is the shared config error.
TrainerConfigError = ConfigError


DirectPositionsPct = Annotated[int, Field(ge=-1, le=100_000)]
"""How deltas code changed positions (chain.codec.api.DIRECT), in the trainer's and `deltaswarm
watch`'s configs. -1: as ranks among elements of the same magnitude, the most compact (a region
counts through each changed tensor once to decode it). N >= 0: directly, in each 1M-element
segment whose positions take at most N % more bits that way, so a region decodes it reading only
the changed elements (on Adam-like updates at 1 % density, 1000 codes every segment directly:
0.55x the decode time for 1.38x the delta bytes). Upgrade every daemon on the chain before
setting it: older builds refuse these deltas (tensor delta mode 3)."""

GroupBelow = Annotated[int, Field(ge=0, le=1 << 20)]
"""Tensors of fewer elements than this travel in group records (chain.writer.GROUP_BELOW): a
run of small tensors (MoE experts) costs one record, payload and digest call instead of one
each (50,000 tensors of 960 elements: publish 2.2x, apply 2.7x faster). 0: a record per tensor,
the only kind daemons from before stop 38 read; set it while such regions remain."""
GROUP_BELOW = 1 << 16
"""chain.writer.GROUP_BELOW, spelled out so loading a config needs no codec (a test holds them
equal)."""


class ModelConfig(Section):
    path: Path | None = None
    """An HF causal-LM directory to train; null builds the embedded default model."""
    seed: int = Field(0, ge=0, le=2**63 - 1)
    """Seed of the default model's initialisation and of the warm-up."""
    hidden: int = Field(128, ge=16, le=8192)
    """Hidden size of the default model (ignored with `path`)."""
    layers: int = Field(2, ge=1, le=128)
    """Transformer layers of the default model (ignored with `path`)."""
    heads: int = Field(4, ge=1, le=128)
    """Attention heads of the default model (ignored with `path`); must divide `hidden`."""


class WarmupConfig(Section):
    steps: int = Field(200, ge=0, le=100_000)
    """Supervised steps on task references before RL (0 skips)."""
    lr: float = Field(3e-3, gt=0, le=1)
    """Learning rate of the warm-up."""
    batch: int = Field(64, ge=1, le=4096)
    """Prompts per warm-up step."""


class GRPOSection(Section):
    lr: float = Field(1e-4, gt=0, le=1)
    """AdamW learning rate on the fp32 master weights."""
    adam_eps: float = Field(1e-4, gt=0, le=1)
    """AdamW epsilon; larger than torch's 1e-8 so near-zero gradients do not move every weight
    by a full lr step (which would change far more bf16 values per version)."""
    is_cap: float = Field(2.0, ge=1, le=1000)
    """Truncated importance sampling cap."""
    max_staleness: int = Field(4, ge=0, le=1000)
    """Trajectories more than this many versions behind the trainer are dropped."""
    grad_clip: float = Field(1.0, gt=0, le=1e6)
    """Gradient norm clip."""
    temperature: float = Field(1.0, gt=0, le=10)
    """Must equal the rollout workers' sampling temperature."""


class DaemonLink(Section):
    url: str | None = Field(None, pattern=r"^https?://\S+$", max_length=2048)
    """The local daemon's control plane; null publishes to the chain dir only."""
    token: str | None = Field(None, min_length=8, max_length=4096)
    """The swarm's bearer token, for POST /v1/publish on that daemon."""


class IngestConfig(Section):
    host: str = Field("127.0.0.1", pattern=r"^[A-Za-z0-9.\-:\[\]]{1,253}$")
    """Address the trajectory ingest endpoint binds to."""
    port: int = Field(8800, ge=1, le=65535)
    """TCP port of the ingest endpoint."""
    token: str = Field(min_length=8, max_length=4096)
    """Bearer token the daemons' forwarders present."""


class TrainerConfig(Section):
    run: str = Field(pattern=NAME_PATTERN)
    """Run name, stamped into every manifest; daemons refuse other runs."""
    state_dir: Path
    """Trainer checkpoints, ingest store and metrics."""
    chain_dir: Path
    """The local daemon's chain directory (`<daemon state_dir>/chain`)."""
    key: Path
    """Ed25519 signing key (created by `deltaswarm keygen` or on first start)."""
    daemon: DaemonLink = DaemonLink()
    """The local daemon the publisher tells about each new version."""
    ingest: IngestConfig
    """Where trajectories arrive from the daemons' forwarders."""
    model: ModelConfig = ModelConfig()
    """The policy to train."""
    task: str = Field("rollout.tasks.arithmetic", min_length=1, max_length=1024)
    """Task plug-in spec (see rollout/tasks/__init__.py)."""
    warmup: WarmupConfig = WarmupConfig()
    """Supervised warm-up before RL."""
    grpo: GRPOSection = GRPOSection()
    """The GRPO objective and optimizer."""
    steps: int = Field(30, ge=1, le=10_000_000)
    """Versions to publish after v0."""
    batch: int = Field(64, ge=1, le=1_000_000)
    """Trajectories per optimizer step (whole groups)."""
    wait_timeout_s: float = Field(600, gt=0, le=7 * 86400)
    """Give up if no trajectory arrives for this long."""
    snapshot_every: int = Field(10, ge=1, le=1_000_000)
    """Publish a full snapshot every this many versions (late joiners start from one)."""
    retention_versions: int = Field(16, ge=1, le=1_000_000)
    """Versions whose artifacts the chain directory keeps when no daemon is linked; with
    `daemon.url` set, the daemon's `retention` settings decide (one decision for both)."""
    block_size: int = Field(4 << 20, ge=1 << 16, le=64 << 20)
    """Size of the content-addressed blocks a version's payload is cut into, in bytes."""
    direct_positions_pct: DirectPositionsPct = -1
    """How deltas code changed positions. -1 (default): the most compact. N >= 0: a segment
    is coded so a region decodes it reading only its changes where that costs at most N % more
    position bits (1000 at 1B: 0.55x the decode, 1.38x the bytes; see DirectPositionsPct).
    Upgrade every daemon first: older builds refuse such deltas."""
    group_below: GroupBelow = GROUP_BELOW
    """Tensors of fewer elements than this travel in group records: a run of small tensors
    (MoE experts) costs one record instead of one each. 0: a record per tensor, the only kind
    daemons from before group records read; set it while such regions remain."""
    on_exit: Literal["stop", "serve"] = "stop"
    """After the last step: exit, or keep the ingest endpoint up."""


PATHS = ("state_dir", "chain_dir", "key", "model.path")


def load_trainer_config(path: str | os.PathLike) -> TrainerConfig:
    """Parse and validate a trainer config; a `ConfigError` names the file and every bad field."""
    return load_yaml(TrainerConfig, path, paths=PATHS)
