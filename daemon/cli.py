"""The `deltaswarm` command: a dispatcher that imports only the subcommand it runs, so
`deltaswarm --help` is instant and `deltaswarm delta …` never loads libtorrent.

    deltaswarm daemon --config configs/trainer.yaml
    deltaswarm status [--watch] [--url URL]
    deltaswarm delta encode|apply|stats …      deltaswarm chain ls|show|verify DIR
    deltaswarm keygen FILE                      deltaswarm demo [--config configs/demo.yaml]
    deltaswarm train --config …                 deltaswarm rollout …
    deltaswarm publish CKPT_DIR --config …      deltaswarm watch DIR --config …
    deltaswarm ingest --config …                deltaswarm init DIR [--regions eu,us]
    deltaswarm config example daemon|publish|ingest|worker|train|demo
"""

import importlib
import sys

COMMANDS = {
    "daemon": ("daemon.main", "run a swarm daemon (trainer node or region)"),
    "status": ("daemon.observe.status_cli", "show a daemon's status (--watch for live)"),
    "delta": ("chain.cli", "encode, apply and inspect delta files"),
    "chain": ("chain.cli", "list, show and verify a chain directory"),
    "keygen": ("chain.keygen", "create the trainer's Ed25519 signing key"),
    "train": ("trainer.main", "run the reference async GRPO trainer"),
    "rollout": ("rollout.worker", "run a rollout worker next to a daemon"),
    "demo": ("demo.main", "trainer + three regions on loopback, live view"),
    "publish": ("trainer.ckpt_cli", "publish one HF checkpoint directory as the next version"),
    "watch": ("trainer.ckpt_cli", "publish each checkpoint a trainer writes, in order"),
    "ingest": ("trainer.ingest_service", "hold trajectories for a trainer you bring"),
    "init": ("deploy.init", "write a working swarm's key, token and configs into a directory"),
    "config": ("deploy.examples", "print a complete commented config of any process"),
}


def usage() -> str:
    lines = [__doc__.strip(), "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    cmd = argv[0]
    if cmd not in COMMANDS:
        print(f"deltaswarm: unknown command {cmd!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[cmd][0])
    # chain.cli and trainer.ckpt_cli parse their own command word; the others get the rest.
    whole = module.__name__ in ("chain.cli", "trainer.ckpt_cli")
    rc = module.main(argv if whole else argv[1:])
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
