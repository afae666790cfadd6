"""The rollout worker's configuration, in the style every process shares (chain/config_base.py):
each field documented and bounded, from a YAML file (`--config`) and/or one flag per field, with
every bad field named at once.

    deltaswarm rollout --config configs/rollout/eu-west.yaml [--group-size 4 ...]
"""

import argparse
import os
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from chain.config_base import NAME_PATTERN, ConfigError, Section, read_yaml, validate


class WorkerConfig(Section):
    daemon: str = Field(pattern=r"^https?://\S+$", max_length=2048)
    """Base URL of the local daemon's control plane."""
    token: str = Field(min_length=1, max_length=4096)
    """The swarm's bearer token (the daemon's `token`)."""
    task: str = Field("rollout.tasks.arithmetic", min_length=1, max_length=1024)
    """Task plug-in spec (see rollout.tasks)."""
    region: str = Field("local", pattern=NAME_PATTERN)
    """Region tag stamped on every trajectory."""
    worker: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
                        min_length=1, max_length=256)
    """Worker name stamped on every trajectory (default host-pid)."""
    run: str | None = Field(None, pattern=NAME_PATTERN)
    """The run this worker generates for, stamped on every trajectory: its daemon and the
    trainer's ingest refuse trajectories of another run (several runs sharing a fleet)."""
    engine: Literal["torch", "vllm"] = "torch"
    """Inference engine: in-process torch, or a vLLM server (see rollout.engine.ENGINES)."""
    vllm_url: str | None = Field(None, pattern=r"^https?://\S+$", max_length=2048)
    """With `engine: vllm`: base URL of the vLLM server this worker generates with and reloads
    each verified version into (`python -m rollout.vllm_launch` starts one: dev mode, scale-out)."""
    vllm_model: str = Field("deltaswarm", min_length=1, max_length=256)
    """With `engine: vllm`: the served model name (`vllm serve --served-model-name`)."""
    prompts_per_batch: int = Field(default=16, ge=1, le=4096)
    """Prompts sampled per batch."""
    group_size: int = Field(default=8, ge=1, le=256)
    """Completions per prompt (one GRPO group)."""
    max_tokens: int = Field(default=6, ge=1, le=32768)
    """Most tokens generated per completion."""
    temperature: float = Field(default=1.0, ge=0.0, le=10.0)
    """Sampling temperature; must equal the trainer's `grpo.temperature`."""
    seed: int = Field(0, ge=0, le=2**63 - 1)
    """Seed of prompt sampling and generation."""
    poll_timeout_s: float = Field(default=30.0, gt=0, le=600)
    """Long-poll wait for a new verified version."""
    retry_max_s: float = Field(default=10.0, gt=0, le=600)
    """Longest delay between retries of a post."""
    drain_s: float = Field(default=10.0, ge=0, le=600)
    """After a stop signal, keep delivering the current batch this long."""
    max_batches: int | None = Field(default=None, ge=1)
    """Stop after this many batches (tests, benchmarks); None runs until signalled."""
    pace_per_version: int | None = Field(default=None, ge=1, le=10_000_000)
    """Trajectories this worker may generate per version the trainer publishes: its share of
    the trainer's batch. The worker then waits for a newer version instead of generating
    trajectories the trainer would drop as stale. None generates without pause."""
    pace_ahead: int = Field(default=1, ge=0, le=1000)
    """With `pace_per_version`: versions of credit beyond the latest one seen, so the next
    batch is generated while the trainer trains (0 = strictly one share per version)."""

    @model_validator(mode="after")
    def _engine_reachable(self) -> "WorkerConfig":
        if self.engine == "vllm" and self.vllm_url is None:
            raise ValueError("engine: vllm needs vllm_url, the base URL of the vLLM server "
                             "(e.g. http://127.0.0.1:8000 from `python -m rollout.vllm_launch`)")
        return self

    def engine_kwargs(self) -> dict[str, Any]:
        """What rollout.engine.make_engine needs for this config's engine."""
        if self.engine == "vllm":
            return {"base_url": self.vllm_url, "model": self.vllm_model}
        return {}


def _flag_type(annotation: Any) -> type:
    for kind in (int, float):
        if annotation in (kind, kind | None):
            return kind
    return str


def parse_args(argv: list[str] | None = None, description: str | None = None
               ) -> tuple[WorkerConfig, int]:
    """(config, torch threads) from `--config FILE` and per-field flags (flags win)."""
    p = argparse.ArgumentParser(prog="deltaswarm rollout", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, field in WorkerConfig.model_fields.items():
        p.add_argument("--" + name.replace("_", "-"), type=_flag_type(field.annotation),
                       help=field.description)
    p.add_argument("--config", type=Path,
                   help="YAML file with any of these fields (flags override it)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ns = vars(p.parse_args(argv))
    threads, path = ns.pop("threads"), ns.pop("config")
    try:
        fields = read_yaml(path) if path is not None else {}
        fields.update({k: v for k, v in ns.items() if v is not None})
        return validate(WorkerConfig, fields, path or "(flags)"), threads
    except ConfigError as e:
        p.error(str(e))
