"""`deltaswarm ingest --config FILE`: the trajectory ingest alone, for a trainer you bring.

The region daemons' forwarders POST trajectories here (`trajectories.forward_url` in their
configs points at `http://HOST:PORT/v1/ingest`); each is stored durably and once, and your
trainer reads them back in order with trainer.consume.Trajectories on `store_dir`.

    # /etc/deltaswarm/ingest.yaml
    store_dir: /var/lib/deltaswarm/ingest
    host: 0.0.0.0
    port: 8800
    token_file: /etc/deltaswarm/token      # the swarm's bearer token, first line

The token comes from a file (or the config), never the command line, where `ps` shows it.
SIGTERM/SIGINT stop it after in-flight requests (systemd: deltaswarm-ingest.service).
"""

import argparse
import sys
from pathlib import Path

from pydantic import Field, model_validator

from chain.config_base import (
    NAME_PATTERN,
    ConfigError,
    Section,
    bearer_token,
    load_yaml,
    one_token,
)


class IngestServiceConfig(Section):
    store_dir: Path
    """Directory of the SQLite store (ingest.db); your trainer reads the same directory."""
    host: str = Field("127.0.0.1", pattern=r"^[A-Za-z0-9.\-:\[\]]{1,253}$")
    """Address to listen on (the daemons' forwarders connect here)."""
    port: int = Field(8800, ge=1, le=65535)
    """TCP port to listen on."""
    token: str | None = Field(None, min_length=8, max_length=4096)
    """The swarm's bearer token the forwarders present; prefer `token_file`."""
    token_file: Path | None = None
    """File holding the swarm's bearer token on its first line (at least 8 characters): one
    secret shared by every daemon, publisher, ingest and worker of the swarm. `deltaswarm init`
    writes one; or `python -c 'import secrets; print(secrets.token_urlsafe(24))' > FILE`.
    Use instead of `token`."""
    max_body_mb: int = Field(64, ge=1, le=4096)
    """Largest POST body accepted, in MiB."""
    run: str | None = Field(None, pattern=NAME_PATTERN)
    """This trainer's run: trajectories stamped with another run are refused (unstamped ones
    are taken). Set it when several runs share a fleet (LoRA runs on one base)."""

    @model_validator(mode="after")
    def _one_token(self) -> "IngestServiceConfig":
        one_token(self.token, self.token_file)
        return self

    def bearer(self) -> str:
        return bearer_token(self.token, self.token_file)


def load_ingest_config(path: str | Path) -> IngestServiceConfig:
    return load_yaml(IngestServiceConfig, path, paths=("store_dir", "token_file"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deltaswarm ingest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, type=Path)
    a = p.parse_args(argv)
    try:
        cfg = load_ingest_config(a.config)
        token = cfg.bearer()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from aiohttp import web

    from trainer.ingest import IngestStore, make_ingest_app

    store = IngestStore(cfg.store_dir, keep_pending=False)
    web.run_app(make_ingest_app(store, token, cfg.max_body_mb << 20, run=cfg.run), host=cfg.host,
                port=cfg.port, print=lambda msg: print(msg, flush=True))
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
