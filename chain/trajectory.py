"""The trajectory record every process agrees on (docs/CONTRACTS.md), and the NDJSON batches that
carry it. The rollout worker builds it, the daemon's spool refuses at POST time exactly what the
trainer's ingest would refuse, and the ingest stores it: one model, so bad data is refused where
it enters and can never block a region's stream further down.
"""

import email.utils
import io
import math
import time
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MAX_LINE = 16 << 20
"""Most bytes in one NDJSON line (one trajectory)."""
MAX_ITEMS = 100_000
"""Most trajectories in one request."""
MAX_TOKENS = 1 << 20
"""Most token ids in a prompt or a completion."""
MAX_TEXT = 8 << 20
"""Most characters in a prompt or a completion."""
LOGPROB_FLOOR = -80.0
"""What a worker sends for a token its engine gave log-probability -inf. exp(-80) is still a
normal float32, so the trainer's importance weight exp(logp - behaviour) is finite and its
truncation (`grpo.is_cap`) applies exactly as it would to the -inf the engine meant."""

TokenId = Annotated[int, Field(ge=0, lt=2**31)]
LogProb = Annotated[float, Field(le=1e-3)]
Name = Annotated[str, Field(max_length=256)]


class BadTrajectory(ValueError):
    """A trajectory batch was refused; the message names the line, the trajectory and the field.
    `index` (0-based, None when the batch as a whole is refused) says which trajectory, so a
    forwarder can set exactly that one aside."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index

    def reply(self) -> dict:
        """The JSON body of the 400 that refuses the batch."""
        return {"error": str(self), "trajectory": self.index}


class Trajectory(BaseModel):
    """One trajectory; unknown fields are ignored. Floats must be finite (no NaN, no ±Infinity)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)

    id: str = Field(pattern=r"^[0-9a-f]{32}$")
    """uuid4 hex: the dedupe key from worker to trainer."""
    version: int = Field(ge=0, lt=2**62)
    """The weights version that generated it."""
    group: str = Field(min_length=1, max_length=256)
    """Completions of one prompt share a group (GRPO normalises rewards within it)."""
    prompt: str = Field(max_length=MAX_TEXT)
    completion: str = Field(max_length=MAX_TEXT)
    prompt_ids: list[TokenId] = Field(min_length=1, max_length=MAX_TOKENS)
    completion_ids: list[TokenId] = Field(max_length=MAX_TOKENS)
    logprobs: list[LogProb] = Field(max_length=MAX_TOKENS)
    """Behaviour log-probability of each completion token (finite, <= 0)."""
    reward: float
    region: Name
    worker: Name
    created: float
    """Unix time the worker built it."""
    run: Name | None = None
    """The run whose weights generated it (optional): the daemon of another run's chain and an
    ingest configured for another run refuse it, so a worker pointed at the wrong run's daemon
    (several LoRA runs on one fleet) is caught at the first hop instead of training the wrong
    policy."""

    @model_validator(mode="after")
    def _aligned(self) -> "Trajectory":
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(f"logprobs has {len(self.logprobs)} entries, completion_ids "
                             f"{len(self.completion_ids)}: need one log-prob per completion token")
        return self


def parse_line(line: bytes | str) -> Trajectory:
    """One JSON line → Trajectory; raises pydantic's ValidationError (JSON errors included)."""
    return Trajectory.model_validate_json(line)


def describe(e: ValidationError) -> str:
    """The first error of a validation as `field F: message` (no input echoed back)."""
    err = e.errors(include_url=False, include_input=False)[0]
    if err["type"] == "json_invalid":
        return f"not valid JSON ({err['msg'].removeprefix('Invalid JSON: ')})"
    field = ".".join(str(p) for p in err["loc"]) or "(object)"
    return f"field {field}: {err['msg']}"


def parse_ndjson(body: bytes, max_items: int = MAX_ITEMS, canonical: bool = False,
                 run: str | None = None) -> list[tuple[str, bytes]]:
    """Every non-blank line validated → [(id, line)]; with `canonical` the line is re-encoded
    from the model (unknown fields dropped). The whole batch is refused with BadTrajectory on the
    first bad line, naming its line (1-based) and trajectory index (0-based).

    Only ids and bytes are kept, never the parsed objects: 100k live objects made each full
    garbage collection hold the GIL for ~0.5 s, stalling the event loop this runs beside.
    `run`: refuse trajectories stamped with another run (unstamped ones pass).
    CPU-bound for big batches: call it off the event loop."""
    out: list[tuple[str, bytes]] = []
    for n, raw in enumerate(io.BytesIO(body), 1):  # line by line: one split held the GIL 0.1 s
        line = raw.strip()
        if not line:
            continue
        where = f"line {n} (trajectory {len(out)})"
        if len(out) >= max_items:
            raise BadTrajectory(f"more than {max_items} trajectories in one request; split it")
        if len(line) > MAX_LINE:
            raise BadTrajectory(f"{where}: {len(line)} bytes exceeds {MAX_LINE}", len(out))
        try:
            t = parse_line(line)
        except ValidationError as e:
            raise BadTrajectory(f"{where}: {describe(e)}", len(out)) from None
        if run is not None and t.run is not None and t.run != run:
            raise BadTrajectory(f"{where}: it is for run {t.run!r}, and this endpoint takes run "
                                f"{run!r}; point the worker at its own run's daemon", len(out))
        out.append((t.id, t.model_dump_json(exclude={"run"} if t.run is None else None).encode()
                    if canonical else line))
    return out


def retry_after_s(value: str | None, default: float, floor: float, ceiling: float) -> float:
    """Seconds to wait from a `Retry-After` header (delta-seconds or an HTTP-date), within
    [floor, ceiling]. Garbage, NaN, negative or missing values give `default` (also clamped):
    a hostile or broken reply can neither spin the sender nor park it for ever."""
    wait = default
    if value is not None:
        try:
            wait = float(value)
        except ValueError:
            try:
                wait = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
            except (TypeError, ValueError, IndexError, OverflowError):
                wait = default
        if not math.isfinite(wait) or wait < 0:
            wait = default
    return min(max(wait, floor), ceiling)
