"""The one trajectory builder for tests: valid records (chain.trajectory.Trajectory) with any
field overridden, and NDJSON bodies of them."""

import json
import time
import uuid
from typing import Any


def trajectory(**over: Any) -> dict[str, Any]:
    """A valid trajectory with a fresh id; keyword arguments replace fields (a value of
    `DROP` removes the field)."""
    t = {"id": uuid.uuid4().hex, "version": 0, "group": "g0", "prompt": "3+4=",
         "completion": "7", "prompt_ids": [1, 9, 12, 10, 13], "completion_ids": [5, 6, 7],
         "logprobs": [-0.5, -0.25, -0.125], "reward": 1.0, "region": "r1", "worker": "w0",
         "created": time.time()}
    t.update(over)
    return {k: v for k, v in t.items() if v is not DROP}


DROP = object()


def batch(n: int, version: int = 0, group_size: int = 4, pad: int = 0, **over: Any
          ) -> list[dict[str, Any]]:
    """`n` valid trajectories in groups of `group_size`, rewards alternating 0/1; `pad` adds
    that many characters to each completion (to size batches)."""
    out = []
    tag = uuid.uuid4().hex[:6]  # groups of one batch never merge with another batch's
    for i in range(n):
        t = trajectory(version=version, reward=float(i % 2), completion="7" + "x" * pad, **over)
        t["group"] = f"g{i // group_size}-{tag}"
        out.append(t)
    return out


def ndjson(items: list[dict[str, Any]]) -> bytes:
    """One JSON object per line (Python's json writes NaN/Infinity literally, as a buggy
    sender would)."""
    return b"".join(json.dumps(t).encode() + b"\n" for t in items)


def ids(items: list[dict[str, Any]]) -> list[str]:
    return [t["id"] for t in items]


def rows(items: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(id, JSON) pairs, as `trainer.ingest.IngestStore.append` takes them."""
    return [(t["id"], json.dumps(t)) for t in items]
