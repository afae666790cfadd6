"""Per-step training metrics: a JSONL log (one object per step, for plots and the demo) and a
one-line human summary for the trainer's log."""

import json
import time
from pathlib import Path
from typing import Any, TextIO

SUMMARY_KEYS = (
    ("reward_mean", "reward {:.3f}"),
    ("solved_frac", "solved {:.2f}"),
    ("kl_behaviour", "kl {:.1e}"),
    ("entropy", "ent {:.2f}"),
    ("is_clipped_frac", "clip {:.2f}"),
    ("bf16_changed_frac", "bf16 {:.2%}"),
    ("tokens_per_s", "{:.0f} tok/s"),
    ("step_s", "{:.2f}s"),
)


def format_step(m: dict[str, Any]) -> str:
    """e.g. `v12 kept 128/130 stale 2 lag {0: 100, 1: 28} reward 0.412 ...`"""
    parts = [f"v{m.get('version')}", f"kept {m.get('kept', 0)}/{m.get('received', 0)}"]
    if m.get("dropped_stale") or m.get("dropped_future"):
        parts.append(f"stale {m.get('dropped_stale', 0)} future {m.get('dropped_future', 0)}")
    if m.get("staleness_hist"):
        parts.append(f"lag {m['staleness_hist']}")
    if not m.get("stepped", True):
        parts.append("no step")
    parts += [fmt.format(m[key]) for key, fmt in SUMMARY_KEYS if key in m]
    return " ".join(parts)


class MetricsLog:
    """Appends each step's metrics with a wall-clock timestamp to a JSONL file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = self.path.open("a", encoding="utf-8")

    def write(self, metrics: dict[str, Any]) -> None:
        row = {"time": time.time(), **metrics}
        if isinstance(row.get("staleness_hist"), dict):
            row["staleness_hist"] = {str(k): v for k, v in row["staleness_hist"].items()}
        self._file.write(json.dumps(row, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
