"""Checkpoints the publisher refused, recorded in the chain directory for the trainer daemon's
status: `deltaswarm watch` runs beside the daemon and shares only the chain dir with it.

One small JSON list (the newest MAX_KEPT, one entry per checkpoint directory), written
atomically; a missing or damaged file reads as empty (it is a report, not state).
"""

import json
from pathlib import Path
from typing import Any

from chain.atomic import write_atomic

REFUSED_FILE = "refused_checkpoints.json"
MAX_KEPT = 50


def read(chain_dir: Path) -> list[dict[str, Any]]:
    try:
        items = json.loads((Path(chain_dir) / REFUSED_FILE).read_text())
    except (OSError, ValueError):
        return []
    return [i for i in items if isinstance(i, dict)][-MAX_KEPT:] if isinstance(items, list) else []


def record(chain_dir: Path, entry: dict[str, Any]) -> None:
    """Add `entry` ({dir, step, reason, at}), replacing an older one for the same dir."""
    kept = [i for i in read(chain_dir) if i.get("dir") != entry.get("dir")]
    data = json.dumps([*kept, entry][-MAX_KEPT:], indent=1).encode()
    write_atomic(Path(chain_dir) / REFUSED_FILE, data, durable=False)
