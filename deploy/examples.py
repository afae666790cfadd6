"""Every process's config, as a complete commented example generated from its pydantic model:
`deltaswarm config example daemon|publish|ingest|worker|train|demo`, and the shipped files in
`configs/` (each one an example with a few values set, written by `make configs`).

Why generated: the hand-written examples disagreed with the code (a default port, watch timings,
a missing `block_size`, a `run` field daemons do not have). Here the fields, their defaults and
their documentation come from the models themselves (chain/config_yaml.py), and
tests/unit/test_configs.py fails when a file in `configs/` is not what this module writes.

This module sits above daemon, trainer and rollout (like demo/, it imports their config models);
none of them imports it.
"""

import argparse
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from chain.config_base import ConfigError, merge, validate
from chain.config_yaml import render

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_KEY = "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c"
"""The public half of an example key: replace it with yours (`deltaswarm keygen`, or
`deltaswarm init` writes configs with your own)."""
EXAMPLE_RUN_KEY = "03a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8"
"""Another example key: a LoRA run's own trainer key (a run may also share the base's)."""
TOKEN_FILE = "/etc/deltaswarm/token"


@dataclass(frozen=True)
class Kind:
    where: str
    """module:Model, imported when used: `config example daemon` needs only the daemon's
    install (a region host has no torch)."""
    run: str
    """How the process is started with such a file."""
    required: dict[str, Any]
    """Values for the fields without a default, so the example loads as it is."""
    tagged: tuple[str, ...] = ()

    @property
    def model(self) -> type[BaseModel]:
        module, _, name = self.where.partition(":")
        return getattr(importlib.import_module(module), name)


KINDS: dict[str, Kind] = {
    "daemon": Kind("daemon.config:Config", "deltaswarm daemon --config FILE", {
        "node": "eu-west-0", "region": "eu-west", "role": "region",
        "state_dir": "/var/lib/deltaswarm/eu-west", "trainer_public_key": EXAMPLE_KEY,
        "token_file": TOKEN_FILE}, tagged=("engine",)),
    "publish": Kind("trainer.ckpt_cli:PublishConfig",
                    "deltaswarm publish CKPT_DIR --config FILE  (or: deltaswarm watch --config "
                    "FILE)", {
        "run": "my-run", "chain_dir": "/var/lib/deltaswarm/trainer/chain",
        "key": "/etc/deltaswarm/trainer.key", "state_dir": "/var/lib/deltaswarm/publish",
        "daemon": {"token_file": TOKEN_FILE}}),
    "ingest": Kind("trainer.ingest_service:IngestServiceConfig",
                   "deltaswarm ingest --config FILE", {
        "store_dir": "/var/lib/deltaswarm/ingest", "token_file": TOKEN_FILE}),
    "worker": Kind("rollout.config:WorkerConfig", "deltaswarm rollout --config FILE", {
        "daemon": "http://127.0.0.1:7600", "token": "change-me-to-the-swarm-token",
        "worker": "rollout-0"}),  # its default is host-pid: a name of the machine it runs on
    "train": Kind("trainer.config:TrainerConfig", "deltaswarm train --config FILE", {
        "run": "grpo-arith-1", "state_dir": "/var/lib/deltaswarm/train",
        "chain_dir": "/var/lib/deltaswarm/trainer/chain", "key": "/etc/deltaswarm/trainer.key",
        "ingest": {"token": "change-me-to-the-swarm-token"}}),
    "demo": Kind("demo.config:DemoConfig", "deltaswarm demo --config FILE", {}),
}


@dataclass(frozen=True)
class Preset:
    kind: str
    about: str
    """What this file is for (the header's first paragraph)."""
    values: dict[str, Any] = field(default_factory=dict)
    """Dotted field name → value, over the kind's required values."""


def _region(name: str, about: str, **values: Any) -> Preset:
    host = f"{name}-0.example.internal"
    return Preset("daemon", about, {
        "node": f"{name}-0", "region": name, "role": "region",
        "state_dir": f"/var/lib/deltaswarm/{name}",
        "http.host": "0.0.0.0", "http.advertise_url": f"http://{host}:7600",
        "bittorrent.host": "0.0.0.0", "bittorrent.advertise_host": host,
        "bootstrap": ["http://trainer.example.internal:7600"],
        "trajectories.upstream": "http://trainer.example.internal:8800/v1/ingest"} | values)


PRESETS: dict[str, Preset] = {
    "trainer.yaml": Preset("daemon", (
        "The trainer node's daemon: seeds every version the local publisher writes into "
        "<state_dir>/chain and serves the chain to the regions; regions announce themselves to "
        "it, so it needs no bootstrap list. Its upload is capped like a thin trainer uplink: "
        "with seed_mode each piece leaves the trainer about once and the regions serve each "
        "other."), {
        "node": "trainer-0", "region": "trainer", "role": "trainer",
        "state_dir": "/var/lib/deltaswarm/trainer",
        "http.host": "0.0.0.0", "http.advertise_url": "http://trainer.example.internal:7600",
        "bittorrent.host": "0.0.0.0", "bittorrent.advertise_host": "trainer.example.internal",
        "limits.upload_bytes_per_s": 6_250_000, "seed_mode": True}),
    "regions/eu-west.yaml": _region(
        "eu-west", "A region next to the trainer's data centre: bootstraps from the trainer, "
        "tells the local engine (an HTTP hook: the built-in rollout worker) about each version, "
        "and forwards trajectories straight to the trainer's ingest.",
        engine={"type": "http", "url": "http://127.0.0.1:7700/v1/version", "timeout_s": 60},
        **{"limits.upload_bytes_per_s": 25_000_000, "trajectories.spool_max_bytes": 1 << 30}),
    "regions/us-east.yaml": _region(
        "us-east", "A region that never talks to the trainer directly: it knows one peer "
        "(eu-west) and relays its trajectories through that daemon's spool. A vLLM server "
        "started with --weight-transfer-config '{\"backend\": \"deltaswarm\"}' serves rollouts "
        "here; its link across the ocean is capped at 100 Mbit/s down.",
        bootstrap=["http://eu-west-0.example.internal:7600"],
        engine={"type": "vllm", "url": "http://127.0.0.1:8000", "timeout_s": 600},
        **{"limits.download_bytes_per_s": 12_500_000,
           "trajectories.upstream": "http://eu-west-0.example.internal:7600/v1/trajectories",
           "trajectories.spool_max_bytes": 4 << 30}),
    "regions/ap-south.yaml": _region(
        "ap-south", "A region whose engine is told by a command (e.g. a script that restarts a "
        "server), with the new version's directory passed as an argument; it keeps fewer "
        "versions on a small disk.",
        bootstrap=["http://trainer.example.internal:7600", "http://eu-west-0.example.internal:7600"],
        engine={"type": "command", "timeout_s": 300, "argv": [
            "/usr/local/bin/reload-engine", "--weights", "{path}", "--version", "{version}"]},
        **{"retention.versions": 4}),
    "regions/eu-west-lora-run-a.yaml": _region(
        "eu-west", "A LoRA run's daemon in eu-west, beside the region's base daemon "
        "(regions/eu-west.yaml following the base chain): it follows run-a's adapter chain from "
        "run-a's own trainer daemon (its own port and key), applies each adapter only over the "
        "base the eu-west base daemon holds, and loads it into the vLLM server serving that base "
        "(--enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING=1) under the name run-a.",
        node="eu-west-run-a", state_dir="/var/lib/deltaswarm/eu-west-run-a",
        trainer_public_key=EXAMPLE_RUN_KEY,
        bootstrap=["http://trainer.example.internal:7601"],
        adapter={"base_weights": "/var/lib/deltaswarm/eu-west/weights", "run": "run-a"},
        engine={"type": "vllm_lora", "url": "http://127.0.0.1:8000", "lora_name": "run-a"},
        **{"http.port": 7601, "http.advertise_url": "http://eu-west-0.example.internal:7601",
           "bittorrent.port": 6882,
           "trajectories.upstream": "http://trainer.example.internal:8801/v1/ingest"}),
    "publish.yaml": Preset("publish", (
        "Publish a trainer's HF checkpoint directories through the trainer node's daemon "
        "(configs/trainer.yaml), with no change to the trainer; systemd: deltaswarm-watch."), {
        "daemon.url": "http://127.0.0.1:7600", "watch.dir": "/srv/checkpoints/my-run"}),
    "ingest.yaml": Preset("ingest", (
        "Hold the trajectories regions send back, for a trainer you bring; it reads them with "
        "trainer.consume.Trajectories(store_dir). Point each region's trajectories.upstream at "
        "http://THIS_HOST:8800/v1/ingest; systemd: deltaswarm-ingest."), {"host": "0.0.0.0"}),
    "train.yaml": Preset("train", (
        "The reference GRPO trainer on the trainer node (systemd: deltaswarm-trainer): it writes "
        "each version into the local daemon's chain directory, asks that daemon "
        "(configs/trainer.yaml) to seed it, and takes trajectories on its ingest port."), {
        "daemon.url": "http://127.0.0.1:7600", "daemon.token": "change-me-to-the-swarm-token",
        "ingest.host": "0.0.0.0", "steps": 1000, "batch": 256}),
    "rollout/eu-west.yaml": Preset("worker", (
        "A rollout worker beside the eu-west daemon (systemd: deltaswarm-rollout@eu-west reads "
        "/etc/deltaswarm/rollout/eu-west.yaml)."), {"region": "eu-west", "worker": "eu-west-0"}),
    "demo.yaml": Preset("demo", (
        "`make demo`: a trainer (with its daemon) and three regions (each a daemon plus a "
        "rollout worker), all separate processes on loopback, state in a fresh directory under "
        "out_dir.\n\n"
        "The task is two-digit arithmetic without carries (rollout/tasks/arithmetic_digits.py): "
        "a fifth of its problems are held out, never sampled by the warm-up or the workers, and "
        "the run passes only if the greedy reward on them rises from v0 to the last version. "
        "A short warm-up teaches the answers only partly, so RL has something to improve. "
        "Rollouts sample at temperature 0.5 and each version trains on 96 prompts x 8: RL's "
        "per-version gradient is mostly noise on this model, and at temperature 1 with 24 "
        "prompts x 16 that noise wore down the greedy answers faster than the signal improved "
        "them. AdamW with a large epsilon (3e-2) acts like momentum SGD on most weights: only "
        "weights with large, consistent gradients move by a whole bf16 step per version, so "
        "about 3 % of elements change per version (real RL at lr ~1e-6: 1-2 %, bench/codec.py); "
        "small epsilons changed 20-70 % per version at any learning rate that moved the reward "
        "here."), {
        "out_dir": "../runs", "steps": 90, "trainer_upload_bytes_per_s": 400_000,
        "warmup.steps": 250, "grpo.lr": 0.0006, "grpo.adam_eps": 0.03,
        "grpo.temperature": 0.5, "batch": 768, "rollout.prompts_per_batch": 16,
        "rollout.group_size": 8, "min_reward_gain": 0.02}),
}


def dotted(values: dict[str, Any]) -> dict[str, Any]:
    """{"a.b": 1} → {"a": {"b": 1}}."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        node = out
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def example(kind: str, values: dict[str, Any] | None = None) -> BaseModel:
    """The validated example of `kind` with `values` (dotted names) set over its required
    ones; ConfigError naming every bad field."""
    k = KINDS[kind]
    return validate(k.model, merge(k.required, dotted(values or {})), f"example {kind}",
                    tagged=k.tagged)


def example_text(kind: str, values: dict[str, Any] | None = None, about: str = "",
                 made_by: str = "", path: str = "FILE") -> str:
    k = KINDS[kind]
    header = "\n\n".join(p for p in (
        about, f"Run: {k.run.replace('FILE', path)}",
        made_by or f"Generated by `deltaswarm config example {kind}` from the "
        f"{k.model.__name__} model: every field, its default and what it does.") if p)
    return render(example(kind, values), header)


def preset_text(name: str) -> str:
    p = PRESETS[name]
    return example_text(p.kind, p.values, p.about,
                        f"Generated by `make configs` (deploy/examples.py) from the "
                        f"{KINDS[p.kind].model.__name__} model; `deltaswarm config example "
                        f"{p.kind}` prints the same with the defaults.", f"configs/{name}")


def write_presets(out: Path = ROOT / "configs") -> list[Path]:
    written = []
    for name in PRESETS:
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(preset_text(name))
        written.append(path)
    return written


def main(argv: list[str] | None = None,
         out: Callable[[str], object] = sys.stdout.write) -> int:
    ap = argparse.ArgumentParser(
        prog="deltaswarm config",
        description="Print a complete commented config for one process, generated from its "
        "model (every field, default and description), or rewrite the shipped examples in "
        "configs/.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("example", help="print a complete commented config of KIND")
    ex.add_argument("kind", choices=sorted(KINDS))
    ex.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="set a (dotted) field, VALUE read as YAML; repeatable "
                    "(e.g. --set http.port=7601 --set bootstrap='[http://10.0.0.1:7600]')")
    sub.add_parser("write-configs", help="rewrite configs/ from deploy/examples.py "
                   "(what `make configs` runs)")
    args = ap.parse_args(argv)
    if args.cmd == "write-configs":
        for path in write_presets():
            out(f"wrote {path.relative_to(ROOT)}\n")
        return 0
    values = {}
    for item in args.set:
        name, eq, raw = item.partition("=")
        if not eq or not name:
            ap.error(f"--set {item!r}: expected FIELD=VALUE, e.g. --set http.port=7601")
        values[name] = yaml.safe_load(raw)
    try:
        out(example_text(args.kind, values))
    except ConfigError as e:
        print(f"deltaswarm config: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
