"""Entry point of the swarm daemon: parse the config, check the ports, then import libtorrent and
run the node on uvloop.

    deltaswarm daemon --config configs/trainer.yaml
    python -m daemon.main --config configs/regions/eu-west.yaml
"""

import argparse
import errno
import logging
import os
import socket
import sys
from pathlib import Path

from chain.errors import ChainError
from daemon.config import Config, ConfigError, load_config


def check_port(host: str, port: int, field: str, path: Path) -> None:
    """Fail early, naming the config field, if host:port cannot be bound (in use, no such
    address); the real servers bind right after."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            why = ("the address is already in use (another daemon or program listens there)"
                   if e.errno == errno.EADDRINUSE else e.strerror or str(e))
            raise ConfigError(f"config {path}: field {field}: cannot listen on {host}:{port}: "
                              f"{why}; pick a free port or stop the other process") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deltaswarm daemon", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, type=Path, help="daemon YAML config")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg: Config = load_config(args.config)
        check_port(cfg.http.host, cfg.http.port, "http.port", args.config)
        check_port(cfg.bittorrent.host, cfg.bittorrent.port, "bittorrent.port", args.config)
    except ConfigError as e:
        print(f"deltaswarm daemon: {e}", file=sys.stderr)
        return 2

    import uvloop

    from daemon.node import serve

    try:
        rc = uvloop.run(serve(cfg, args.config))
    except (ConfigError, ChainError) as e:
        print(f"deltaswarm daemon: {e}", file=sys.stderr)
        return 2
    # Everything is stopped, fsync'd and saved; skip the slow interpreter teardown (torch,
    # libtorrent, numba) so a stop stays within systemd's TimeoutStopSec.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
