"""What a node reports about itself: the `NodeStatus` model served as `GET /v1/status` JSON (and
turned into Prometheus metrics by `daemon.observe.metrics`). `daemon.observe.report` fills it in
fresh on each
request from the running node's parts. Every field has a default so a partial report is valid.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

TransferState = Literal["fetching", "applying", "current", "seeding", "failed"]
TRANSFER_STATES: tuple[TransferState, ...] = (
    "fetching", "applying", "current", "seeding", "failed",
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", validate_assignment=True)


class Transfer(_Model):
    """One artifact (`v00000005.delta`) this node fetches, applies or seeds."""

    artifact: str
    version: int | None = None
    state: TransferState = "fetching"
    done_bytes: int = Field(0, ge=0, description="bytes of the artifact held and verified")
    total_bytes: int = Field(0, ge=0, description="size of the artifact (all its blocks)")
    tensor_bytes: int = Field(0, ge=0, description="of total_bytes, the tensor payload")
    file_bytes: int = Field(0, ge=0, description="of total_bytes, the carried files (config, "
                            "tokenizer, ...); unchanged ones are the previous version's blocks")
    download_rate: float = Field(0.0, ge=0, description="bytes/s, now")
    upload_rate: float = Field(0.0, ge=0, description="bytes/s, now")
    bytes_up: int = Field(0, ge=0, description="bytes of this artifact uploaded to peers")
    peers: int = Field(0, ge=0, description="peers connected on this artifact's torrent")
    error: str | None = Field(None, description="why it failed, when state == 'failed'")

    @computed_field
    @property
    def progress(self) -> float:
        return self.done_bytes / self.total_bytes if self.total_bytes else 0.0


class Peer(_Model):
    """A node this one knows: by its control-plane URL, its BitTorrent endpoint, or both."""

    node: str | None = None
    http_url: str | None = None
    bt_endpoint: str | None = Field(None, description="host:port")
    bytes_up: int = Field(0, ge=0, description="bytes this node sent to the peer")
    bytes_down: int = Field(0, ge=0, description="bytes this node received from the peer")
    download_rate: float = Field(0.0, ge=0)
    upload_rate: float = Field(0.0, ge=0)
    last_seen: float | None = Field(None, description="unix time of the last contact")

    @property
    def key(self) -> str:
        return self.bt_endpoint or self.http_url or self.node or "?"


class Totals(_Model):
    """Bytes moved since start, and what shipping full checkpoints would have cost instead.

    Sizes are the tensor payload and the carried files (config, tokenizer, ...) apart: every
    version lists its carried files, but unchanged ones are the same content-addressed blocks,
    held once and not fetched again, so adding them to each version's size overstated it (1 MB
    deltas whose tensors were 0.22-0.29 MB, issue 22). `bytes_saved` and `smaller_on_tensors`
    are on tensors only.
    """

    bytes_up: int = Field(0, ge=0)
    bytes_down: int = Field(0, ge=0)
    tensor_bytes: int = Field(0, ge=0, description="tensor payload of the applied versions")
    full_tensor_bytes: int = Field(0, ge=0, description="the same versions' tensors "
                                   "uncompressed: what full checkpoints' tensors weigh")
    file_bytes: int = Field(0, ge=0, description="carried files (config, tokenizer, ...) the "
                            "applied versions list, counted once per version")
    new_file_bytes: int = Field(0, ge=0, description="of file_bytes, those not in the version "
                                "applied before (the rest: the same blocks, not fetched again)")
    versions_applied: int = Field(0, ge=0)

    @computed_field(description="tensor_bytes + file_bytes: every applied version's artifact "
                    "bytes, carried files counted once per version")
    @property
    def payload_bytes(self) -> int:
        return self.tensor_bytes + self.file_bytes

    @computed_field(description="full_tensor_bytes + file_bytes")
    @property
    def full_bytes(self) -> int:
        return self.full_tensor_bytes + self.file_bytes

    @computed_field(description="full_tensor_bytes - tensor_bytes: saved on tensors")
    @property
    def bytes_saved(self) -> int:
        return max(0, self.full_tensor_bytes - self.tensor_bytes)

    @computed_field(description="full_tensor_bytes / tensor_bytes (None before any payload)")
    @property
    def smaller_on_tensors(self) -> float | None:
        return self.full_tensor_bytes / self.tensor_bytes if self.tensor_bytes else None


class Rates(_Model):
    download: float = Field(0.0, ge=0, description="bytes/s over all torrents")
    upload: float = Field(0.0, ge=0, description="bytes/s over all torrents")


class Verification(_Model):
    """Data that failed a check: `piece` (v2 hash), `block` (xxh3 id), `tensor`, `state`."""

    failures_by_kind: dict[str, int] = Field(default_factory=dict)
    last_error: str | None = None
    last_at: float | None = None

    @computed_field
    @property
    def failures(self) -> int:
        return sum(self.failures_by_kind.values())


class Ban(_Model):
    """A peer refused on one artifact's torrent because it sent data failing the hash check."""

    endpoint: str = Field(description="the peer's BitTorrent ip:port")
    artifact: str = Field(description="the torrent the ban applies to; others are unaffected")
    node: str | None = Field(None, description="the peer's node name, when the book knows it")
    reason: str
    since: float = Field(description="unix time the ban was made")
    expires: float = Field(description="unix time the ban ends")


class SelfCheckCorrupt(_Model):
    artifact: str
    block: str
    at: float
    repaired: bool = False


class SelfCheckStatus(_Model):
    """Re-verification of the blocks this node serves, against their content-addressed ids."""

    state: Literal["idle", "running"] = "idle"
    runs: int = Field(0, ge=0, description="passes finished since start")
    last_run_at: float | None = Field(None, description="unix time the last pass finished")
    last_seconds: float | None = None
    last_trigger: str | None = Field(
        None, description="start | schedule | hash_failed | complaint")
    bytes_checked: int = Field(0, ge=0, description="bytes read and hashed since start")
    blocks_checked: int = Field(0, ge=0)
    corrupt_found: int = Field(0, ge=0, description="blocks found corrupt since start")
    repaired: int = Field(0, ge=0, description="corrupt blocks refetched and verified")
    corrupt: list[SelfCheckCorrupt] = Field(default_factory=list,
                                            description="the most recent finds, oldest first")
    bytes_per_s: int = Field(0, ge=0, description="read budget")
    interval_s: float = Field(0.0, ge=0, description="seconds between scheduled passes")


class WeightsCheckFind(_Model):
    version: int
    tensors: list[str] = Field(description="the first ten tensors that differed")
    count: int = Field(ge=0, description="tensors that differed")
    at: float
    action: str = Field(description="what was done: set aside and rebuilt, or deleted")


class WeightsCheckStatus(_Model):
    """Regions: scheduled re-hashing of every held weight directory against its digests
    (daemon/versions/weights_check.py); the start-up check is `weights_problem`."""

    enabled: bool = True
    state: Literal["idle", "running"] = "idle"
    runs: int = Field(0, ge=0, description="passes finished since start")
    last_run_at: float | None = Field(None, description="unix time the last pass finished")
    last_seconds: float | None = None
    bytes_checked: int = Field(0, ge=0, description="bytes read and hashed since start")
    versions_checked: int = Field(0, ge=0)
    damaged_found: int = Field(0, ge=0, description="directories found damaged and set aside")
    found: list[WeightsCheckFind] = Field(default_factory=list,
                                          description="the most recent finds, oldest first")
    bytes_per_s: int = Field(0, ge=0, description="read budget")
    interval_s: float = Field(0.0, ge=0, description="seconds between passes")


class Warmup(_Model):
    """Compiling the codec and digest kernels in the background at start, so the first apply
    costs what later ones do."""

    state: Literal["pending", "running", "ready", "failed", "off"] = Field(
        "pending", description="off: a trainer's daemon, which never applies")
    seconds: float | None = Field(None, description="how long compiling (or loading the numba "
                                  "cache) took")
    error: str | None = None
    kernels: str | None = Field(None, description="aot: compiled at install, nothing to "
                                "compile; jit: numba compiles them (chain/codec/aot.py)")


class RefusedManifest(_Model):
    artifact: str | None = None
    source: str | None = Field(None, description="the URL it came from")
    kind: str = Field(
        "invalid",
        description="unsigned | bad_signature | replay | wrong_parent | invalid | ...",
    )
    reason: str
    at: float


class EngineStatus(_Model):
    type: str | None = Field(None, description="the engine hook's type from the config")
    notifications: int = Field(0, ge=0, description="successful notifications")
    failures: int = Field(0, ge=0)
    last_version: int | None = Field(None, description="last version the engine took")
    last_ok_at: float | None = None
    last_error: str | None = None
    last_error_at: float | None = None


class AdapterStatus(_Model):
    """A daemon following a LoRA run: the base its adapters apply over and what vLLM serves."""

    base: dict | None = Field(None, description="run, version, state_digest and path of the "
                              "base the newest adapter version applies over")
    base_problem: str | None = Field(None, description="why the newest adapter version is not "
                                     "applied (its base is not held here); None when it is")
    lora_name: str | None = Field(None, description="the name this run's adapter is served as")
    engine_version: int | None = Field(None, description="adapter version vLLM serves under "
                                       "lora_name, as its model list showed after the last load")
    engine_adapters: dict[str, int | None] = Field(
        default_factory=dict, description="every adapter the vLLM server listed right after "
        "this daemon's last load (all runs sharing it): name -> version of its directory")
    load_s: float = Field(0.0, ge=0, description="seconds the last adapter load took")


class EngineCheckStatus(_Model):
    """Proof the engine's live weights are the version's (the vLLM backend hook reads them back
    after every update and compares with the version's digests; daemon/engines/vllm.py)."""

    enabled: bool = True
    last_version: int | None = Field(None, description="version the last check was for")
    ok: bool | None = Field(None, description="False: live weights differ; None: not checked")
    mode: str | None = Field(None, description="how the last update applied: patch|changed|full")
    checked: int = Field(0, ge=0, description="tensors read back and matching, last check")
    unreadable: int = Field(0, ge=0, description="tensors the engine could not read back")
    mismatched: list[str] = Field(default_factory=list,
                                  description="tensors that differed at the last mismatch")
    loaded_tensors: int = Field(0, ge=0)
    loaded_bytes: int = Field(0, ge=0)
    update_s: float = Field(0.0, ge=0, description="last update, pause to resume")
    check_s: float = Field(0.0, ge=0, description="last read-back")
    checks: int = Field(0, ge=0)
    mismatches: int = Field(0, ge=0, description="checks that failed (each set off a full reload)")
    repairs: int = Field(0, ge=0, description="full reloads that then verified")
    repair_failures: int = Field(0, ge=0, description="full reloads that still differed")
    last_mismatch_version: int | None = None
    last_mismatch_at: float | None = None
    last_error: str | None = None
    phases: dict[str, float] = Field(default_factory=dict,
                                     description="seconds per vLLM call of the last update")
    reason: str | None = Field(None, description="why the last update was not all patched in "
                               "place (module reload, or no patch file)")
    kind: str | None = Field(None, description="what the last check read: incremental (the "
                             "words the patch touched) | full")
    words: int = Field(0, ge=0, description="64-bit words the last incremental check read")
    state_digest_ok: bool | None = Field(None, description="the engine's tracked digests give "
                                         "the patch's state digest")
    full_check: dict[str, Any] = Field(default_factory=dict, description="the last whole "
                                       "read-back: at, version, why, ok, checked, unreadable, "
                                       "mismatched, seconds")


class SpoolStatus(_Model):
    upstream: str | None = None
    depth: int = Field(0, ge=0, description="trajectories held, not yet acknowledged")
    bytes: int = Field(0, ge=0)
    received: int = Field(0, ge=0, description="trajectories accepted from workers")
    forwarded: int = Field(0, ge=0, description="trajectories acknowledged upstream")
    forward_rate: float = Field(0.0, ge=0, description="trajectories/s acknowledged, recent")
    rejected_full: int = Field(0, ge=0, description="posts answered 429 (spool full)")
    errors: int = Field(0, ge=0, description="failed forwarding attempts")
    rejected_invalid: int = Field(
        0, ge=0, description="trajectories the upstream refused as invalid (set aside, never "
        "resent; see the spool's rejected store)")
    last_rejected: str | None = None
    last_error: str | None = None
    last_error_at: float | None = None


class NodeStatus(_Model):
    """The whole report. `lag` is None while the node holds no version yet."""

    node: str = ""
    region: str = ""
    role: str = Field("region", description="trainer | region")
    http_url: str | None = None
    bt_endpoint: str | None = None
    time: float = Field(0.0, description="unix time this snapshot was taken")
    uptime_s: float = Field(0.0, ge=0)
    current_version: int | None = None
    head_version: int | None = None
    state_digest: str | None = None
    versions: list[Transfer] = Field(default_factory=list)
    peers: list[Peer] = Field(default_factory=list)
    totals: Totals = Field(default_factory=Totals)
    rates: Rates = Field(default_factory=Rates)
    verification: Verification = Field(default_factory=Verification)
    bans: list[Ban] = Field(default_factory=list,
                            description="bad-data bans, one per (peer endpoint, artifact)")
    self_check: SelfCheckStatus = Field(default_factory=SelfCheckStatus)
    weights_check: WeightsCheckStatus | None = Field(
        None, description="regions only: the scheduled check of the stored weights")
    warmup: Warmup = Field(default_factory=Warmup)
    refused_manifests: list[RefusedManifest] = Field(
        default_factory=list, description="the most recent refusals, oldest first"
    )
    refused_by_kind: dict[str, int] = Field(default_factory=dict)
    engine: EngineStatus = Field(default_factory=EngineStatus)
    engine_check: EngineCheckStatus | None = Field(
        None, description="vLLM backend hook only: the weight check after each update")
    adapter: AdapterStatus | None = Field(
        None, description="LoRA runs only: base held, adapter versions served (engines/lora.py)")
    spool: SpoolStatus = Field(default_factory=SpoolStatus)
    weights_problem: str | None = Field(
        None, description="what the start-up or scheduled check of the weights found last (the "
        "damaged version was set aside and the node rebuilds from the best snapshot); None "
        "when they verified")
    last_apply_s: float | None = Field(
        None, ge=0, description="seconds the last version's apply took (verified, journaled)")
    identity: dict | None = Field(
        None, description="this node's identity key fingerprint and the claims to node names it "
        "refused (daemon/peering/identity.py; filled by the node, not by build_status)")

    @computed_field
    @property
    def lag(self) -> int | None:
        if self.head_version is None:
            return 0
        if self.current_version is None:
            return None
        return max(0, self.head_version - self.current_version)

    @computed_field
    @property
    def refused_total(self) -> int:
        return sum(self.refused_by_kind.values())
