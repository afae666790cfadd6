"""`deltaswarm init DIR`: everything a swarm needs to start, in one directory: the trainer's
signing key, the swarm's token, the trainer node's daemon config, one config per region (with
the trainer's public key and address filled in), `publish.yaml` (publish or watch your trainer's
HF checkpoints) and `ingest.yaml` (hold the trajectories regions send back), and the state
directories they name. Every file works as written: start the daemons, publish a checkpoint,
and the regions follow.

    deltaswarm init swarm                                  # trainer + eu-west, us-east on loopback
    deltaswarm init swarm --regions eu@10.0.1.5,us@10.0.2.5 --trainer-host 10.0.0.5

Ports, from --base-port B (default 7600): the trainer's daemon listens on B (HTTP) and B+1
(BitTorrent), the ingest on B+2; region i (from 0) on B+10(i+1) and one above. Every node may
run on one host (the default) or each on its own (`name@host`).

The configs are rendered from the config models (chain/config_yaml.py, like `deltaswarm config
example`), so each field is written with its default and documentation: change what you need.
"""

import argparse
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

from chain import keys
from chain.config_base import ConfigError
from daemon.peering.names import BadName, check_node
from deploy.examples import example_text

DEFAULT_REGIONS = "eu-west,us-east"


@dataclass(frozen=True)
class Node:
    name: str
    host: str
    http_port: int
    bt_port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.http_port}"


def plan(regions: str, trainer_host: str, base_port: int) -> tuple[Node, int, list[Node]]:
    """The trainer node, the ingest port and the region nodes from the command line's words;
    ValueError naming what is wrong."""
    if not 1024 <= base_port <= 65535 - 10 * (len(regions.split(",")) + 1) - 1:
        raise ValueError(f"--base-port {base_port}: the ports from it must fit in 1024-65535")
    trainer = Node("trainer", trainer_host, base_port, base_port + 1)
    out: list[Node] = []
    for i, item in enumerate(r.strip() for r in regions.split(",")):
        name, _, host = item.partition("@")
        try:
            check_node(name)
        except BadName as e:
            raise ValueError(f"--regions: {e}") from None
        if name in ("trainer", *(n.name for n in out)):
            raise ValueError(f"--regions: {name!r} is named twice (or is 'trainer')")
        port = base_port + 10 * (i + 1)
        out.append(Node(name, host or trainer_host, port, port + 1))
    if not out:
        raise ValueError("--regions: name at least one region")
    return trainer, base_port + 2, out


def write(out: Path, regions: str = DEFAULT_REGIONS, trainer_host: str = "127.0.0.1",
          base_port: int = 7600, run: str = "my-run") -> tuple[dict[str, Path], str]:
    """Write the swarm's files under `out` (which must not hold them already): (name → path,
    the trainer's public key)."""
    trainer, ingest_port, nodes = plan(regions, trainer_host, base_port)
    out = out.resolve()
    files = {"key": out / "trainer.key", "token": out / "token",
             "trainer": out / "trainer.yaml", "publish": out / "publish.yaml",
             "ingest": out / "ingest.yaml",
             **{f"region {n.name}": out / "regions" / f"{n.name}.yaml" for n in nodes}}
    there = [p for p in files.values() if p.exists()]
    if there:
        raise FileExistsError(f"{there[0]} exists: init writes a new swarm (a new key and "
                              "token); choose an empty directory")
    state = out / "state"
    (out / "regions").mkdir(parents=True, exist_ok=True)
    for d in ("trainer", "publish", "ingest", "checkpoints", *(n.name for n in nodes)):
        (state / d).mkdir(parents=True, exist_ok=True)
    files["token"].write_text(secrets.token_urlsafe(24) + "\n")
    files["token"].chmod(0o600)
    public = keys.public_hex(keys.generate(files["key"]))
    token_file = str(files["token"])
    ingest_url = f"http://{trainer.host}:{ingest_port}/v1/ingest"

    def daemon(node: Node, about: str, **values: object) -> str:
        return example_text("daemon", {
            "node": node.name, "region": node.name, "state_dir": str(state / node.name),
            "http.host": node.host, "http.port": node.http_port,
            "bittorrent.host": node.host, "bittorrent.port": node.bt_port,
            "trainer_public_key": public, "token_file": token_file, **values}, about,
            made_by="Written by `deltaswarm init`; every field is shown with its default.",
            path=str(files["trainer" if node is trainer else f"region {node.name}"]))

    files["trainer"].write_text(daemon(
        trainer, "The trainer node's daemon: seeds every version `deltaswarm publish` / "
        "`watch` (publish.yaml) writes into its state_dir/chain; the regions bootstrap from it.",
        role="trainer", seed_mode=True))
    for n in nodes:
        files[f"region {n.name}"].write_text(daemon(
            n, f"Region {n.name}: follows the trainer's versions through the swarm, keeps the "
            "current one in state_dir/weights/current (engine: none; set `engine` to tell vLLM "
            "or a rollout worker), and forwards trajectories to the ingest.",
            role="region", bootstrap=[trainer.url],
            **{"trajectories.upstream": ingest_url}))
    files["publish"].write_text(example_text("publish", {
        "run": run, "chain_dir": str(state / "trainer" / "chain"), "key": str(files["key"]),
        "state_dir": str(state / "publish"), "daemon.url": trainer.url,
        "daemon.token_file": token_file, "watch.dir": str(state / "checkpoints")},
        "Publish HF checkpoint directories as versions through the trainer node's daemon "
        "(trainer.yaml): `deltaswarm publish CKPT_DIR` for one, `deltaswarm watch` for every "
        "step your trainer writes into watch.dir.",
        made_by="Written by `deltaswarm init`.", path=str(files["publish"])))
    files["ingest"].write_text(example_text("ingest", {
        "store_dir": str(state / "ingest"), "host": trainer.host, "port": ingest_port,
        "token_file": token_file},
        "Holds the trajectories the regions send back (their trajectories.upstream points "
        "here), for your trainer to read with trainer.consume.Trajectories(store_dir).",
        made_by="Written by `deltaswarm init`.", path=str(files["ingest"])))
    return files, public


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deltaswarm init", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, help="directory to write into (created; must not hold "
                   "a swarm already)")
    p.add_argument("--regions", default=DEFAULT_REGIONS,
                   help="comma-separated region names, each optionally name@host "
                   f"(default {DEFAULT_REGIONS}, on --trainer-host)")
    p.add_argument("--trainer-host", default="127.0.0.1",
                   help="address of the trainer node (and of regions without @host)")
    p.add_argument("--base-port", type=int, default=7600, help="first port (see above)")
    p.add_argument("--run", default="my-run", help="run name stamped into every manifest")
    a = p.parse_args(argv)
    try:
        files, public = write(a.dir, a.regions, a.trainer_host, a.base_port, a.run)
    except (ValueError, FileExistsError, ConfigError, OSError) as e:
        print(f"deltaswarm init: {e}", file=sys.stderr)
        return 2
    d = a.dir
    regions = [k.split(" ", 1)[1] for k in files if k.startswith("region ")]
    print(f"wrote a swarm into {d}/ (trainer public key {public})\n")
    print("start the trainer node's daemon, then each region (each in its own terminal, or as "
          "systemd units: systemd/README.md):")
    print(f"  deltaswarm daemon --config {d}/trainer.yaml")
    for r in regions:
        print(f"  deltaswarm daemon --config {d}/regions/{r}.yaml")
    print("publish a checkpoint (an HF model directory), or follow a trainer's output:")
    print(f"  deltaswarm publish CKPT_DIR --config {d}/publish.yaml")
    print(f"  deltaswarm watch --config {d}/publish.yaml      # every step_N/ in "
          f"{d}/state/checkpoints")
    print("watch it arrive:")
    print(f"  deltaswarm status --watch --config {d}/regions/{regions[0]}.yaml")
    print(f"keep {d}/trainer.key and {d}/token secret; copy the token to every node.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
