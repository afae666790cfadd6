"""The daemon configuration: one pydantic tree loaded from YAML, each field documented and bounded.

`load_config(path)` is the only entry: it reads the YAML, resolves relative paths against the
config file's directory, validates, and turns any problem into a `ConfigError` whose message
names the file and every bad field (the style of chain/config_base.py, shared by every process).
"""

import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from chain.config_base import ConfigError, bearer_token, load_yaml, one_token
from chain.config_base import Section as _Section
from chain.policy import Retention
from daemon.peering.names import NODE_NAME, BadName, check_url

__all__ = ["Config", "ConfigError", "check_state_dir", "load_config"]

_HOST = r"^[A-Za-z0-9.\-:\[\]]{1,253}$"
_URL = r"^https?://[A-Za-z0-9.\-\[\]:]+(:\d{1,5})?(/[^\s]*)?$"
Url = Annotated[str, Field(pattern=_URL, max_length=2048)]


def _daemon_url(url: str) -> str:
    """Another daemon's control URL: the API root (daemon/peering/names.py), no path or query."""
    try:
        return check_url(url)
    except BadName as e:
        raise ValueError(str(e)) from None


class HttpListen(_Section):
    host: str = Field("127.0.0.1", pattern=_HOST)
    """Address the control plane (aiohttp) binds to."""
    port: int = Field(7600, ge=1, le=65535)
    """TCP port of the control plane."""
    advertise_url: Url | None = None
    """URL other daemons use to reach this one; default http://host:port (set it when binding
    0.0.0.0 or behind NAT)."""
    max_body_bytes: int = Field(64 << 20, ge=1 << 16, le=1 << 30)
    """Largest request body accepted (trajectory batches), in bytes."""

    @field_validator("advertise_url")
    @classmethod
    def _api_root(cls, v: str | None) -> str | None:
        return None if v is None else _daemon_url(v)

    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return (self.advertise_url or f"http://{host}:{self.port}").rstrip("/")


class BtListen(_Section):
    host: str = Field("127.0.0.1", pattern=_HOST)
    """Address the BitTorrent session listens on and connects from (bans are per address)."""
    port: int = Field(6881, ge=0, le=65535)
    """TCP port for BitTorrent peers; 0 picks a free one."""
    advertise_host: str | None = Field(None, pattern=_HOST)
    """Host other daemons connect to; default `host` (set it when binding 0.0.0.0)."""
    piece_size: int = Field(1 << 20, ge=1 << 14, le=1 << 24)
    """Torrent piece size in bytes (power of two); every node of a swarm must use the same."""

    @field_validator("piece_size")
    @classmethod
    def _pow2(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"{v} is not a power of two (e.g. 262144, 1048576)")
        return v


class Limits(_Section):
    upload_bytes_per_s: int = Field(0, ge=0, le=1 << 40)
    """Swarm upload cap in bytes/s; 0 = unlimited. Applies on private addresses too."""
    download_bytes_per_s: int = Field(0, ge=0, le=1 << 40)
    """Swarm download cap in bytes/s; 0 = unlimited."""


class RegionPeeringConfig(_Section):
    mode: Literal["aware", "blind"] = "aware"
    """`aware`: dial peers of this region, and only each region's gateways across regions, with
    peer exchange off (daemon/peering/regions.py); `blind`: dial every known peer (pre-issue-14)."""
    gateways: int = Field(1, ge=1, le=64)
    """Nodes per region that fetch across regions (more: faster failover, more cross-region
    bytes)."""
    gateway_deadline_s: float = Field(5.0, gt=0, le=3600)
    """A node downloading what a peer holds that receives nothing for this long passes over
    its region's gateway (demotes it) and the next member, or itself, fetches across regions
    (seconds: far below sync.progress_timeout_s)."""
    gateway_demote_s: float = Field(120.0, gt=0, le=3600)
    """How long a demoted gateway stays passed over; doubles on each repeat, at most 1 h."""


class RetentionConfig(_Section):
    versions: int = Field(8, ge=1, le=100_000)
    """Artifacts of the last this many versions are kept and seeded (plus the snapshot and
    deltas a late joiner needs to reach them)."""
    weight_dirs: int = Field(2, ge=1, le=100)
    """Reconstructed HF weight directories kept on disk (the current one included)."""
    behind_budget_bytes: int = Field(1 << 30, ge=0, le=1 << 50)
    """Artifact bytes kept beyond `versions` so live nodes that are behind still reach the head
    by deltas from their own version; past it they fall back to a snapshot (status `retention`
    says for whom). 0 keeps the window only."""
    live_within_s: float = Field(120.0, gt=0, le=86400)
    """A node counts as live (its version is kept for) if it long-polled this daemon's head
    within this many seconds."""

    def policy(self) -> Retention:
        return Retention(versions=self.versions, behind_budget_bytes=self.behind_budget_bytes)


class SyncConfig(_Section):
    progress_timeout_s: float = Field(20.0, gt=0, le=86400)
    """A download that gains no bytes for this long is given up (its partial data kept for
    resume) and the region replans around that artifact."""
    unoffered_timeout_s: float = Field(10.0, gt=0, le=86400)
    """An artifact no peer has listed as held for this long counts as gone: plans go around it
    (a later snapshot plus deltas)."""
    head_quorum: int = Field(3, ge=1, le=1000)
    """Before its first plan a region waits for head replies from this many peers (or from
    every peer it knows, or `head_wait_s`), so it plans once toward the real head."""
    head_wait_s: float = Field(3.0, ge=0, le=600)
    """Longest wait for `head_quorum` after the first head reply."""
    engine_first: bool = True
    """A verified delta goes to the engines as one patch file (their live weights patched in
    place) before the directory on disk is brought forward (daemon/engines/first.py)."""
    disk_batch_versions: int = Field(4, ge=1, le=1000)
    """Engine first: bring the disk forward once this many versions wait (one pass for all)."""
    disk_idle_s: float = Field(1.0, ge=0, le=3600)
    """Engine first: or once no new version was verified for this long."""
    region_wait_s: float = Field(2.0, ge=0, le=60)
    """A node hearing of a version that no peer it should ask first holds yet waits up to this
    long for one to before asking the trainer: a region's members wait for their region's
    fetcher (jittered, from half of it), each region's fetcher a quarter of it for the fleet's
    fetcher (RegionPeering.fetch_role); the wait ends as soon as one holds the manifest. 0: ask
    the trainer at once. Keeps the trainer's control-plane load flat in the number of nodes
    and regions (docs/SCALE.md)."""


class BanConfig(_Section):
    expiry_s: float = Field(3600.0, ge=10, le=7 * 86400)
    """How long a peer that sent data failing the hash check stays banned on that artifact."""


class SelfCheckConfig(_Section):
    on_start: bool = True
    """Re-verify every served block once at start (in the background, within the budget)."""
    interval_s: float = Field(3600.0, ge=1, le=30 * 86400)
    """Seconds between scheduled passes over everything served."""
    weights: bool = True
    """Regions: also re-hash every held weight directory on the same schedule and budget (an
    apply verifies each tensor from the words it touched, so damage elsewhere is found only
    here or at start); a damaged one is set aside and rebuilt, as at start."""
    bytes_per_s: int = Field(200_000_000, ge=1 << 20, le=1 << 40)
    """Read budget of a pass: keep it well under the disk's throughput so serving and applying
    stay fast (a 14 GB model takes 70 s at the default)."""


class NoHook(_Section):
    type: Literal["none"] = "none"
    """Tell no engine; engines may long-poll GET /v1/weights/current instead."""


class HttpHook(_Section):
    type: Literal["http"]
    """POST each verified version to an HTTP endpoint."""
    url: Url
    """POSTed {"version", "state_digest", "path"} after each verified version."""
    timeout_s: float = Field(30.0, gt=0, le=3600)
    """Give up on one notification after this long (it is retried, then counted as failed)."""


class CommandHook(_Section):
    type: Literal["command"]
    """Run a program after each verified version."""
    argv: list[str] = Field(min_length=1, max_length=256)
    """Program and arguments; `{version}`, `{path}`, `{state_digest}` are substituted, and the
    same values are in DELTASWARM_VERSION / _PATH / _STATE_DIGEST."""
    timeout_s: float = Field(300.0, gt=0, le=86400)
    """Kill the command after this long."""

    @field_validator("argv")
    @classmethod
    def _known_placeholders(cls, argv: list[str]) -> list[str]:
        for arg in argv:
            try:
                arg.format_map({"version": 1, "path": "p", "state_digest": "d"})
            except (KeyError, ValueError, IndexError) as e:
                raise ValueError(f"argument {arg!r}: only {{version}}, {{path}} and "
                                 f"{{state_digest}} may be substituted ({e!r})") from None
        return argv


class VllmHook(_Section):
    type: Literal["vllm"]
    """Update a vLLM server's weights in place (pause, update, check, reset cache, resume)."""
    url: Url
    """Base URL of a vLLM server started with VLLM_SERVER_DEV_MODE=1."""
    timeout_s: float = Field(600.0, gt=0, le=86400)
    """Budget for one step of the update (one HTTP call to vLLM)."""
    transfer: Literal["backend", "reload"] = "backend"
    """backend: vLLM's weight-transfer API with the `deltaswarm` backend (vLLM >= 0.32, served
    with --weight-transfer-config '{"backend": "deltaswarm"}'), changed tensors only, checked
    after each update (tested on 0.32.0). reload: whole-directory reload_weights over
    /collective_rpc, for older vLLM without the backend (reload_weights(weights_path) is in vLLM
    since at least 0.14; tested here on 0.32.0); no check."""
    mode: Literal["auto", "patch", "changed", "full"] = "auto"
    """backend only: auto patches in place where the engine allows, else reloads the changed
    modules; full reloads every tensor."""
    check: bool = True
    """backend only: read the live weights back after each update and compare them with the
    version's digests; a mismatch triggers a full reload."""
    full_check_every: int = Field(20, ge=0, le=1_000_000)
    """backend only, patch updates: besides the incremental check of the words each patch
    touched, read every tensor back on every Nth update (0: only on request,
    POST /v1/engine/check)."""


class VllmLoraHook(_Section):
    type: Literal["vllm_lora"]
    """Load each adapter version into a vLLM server started on the base with --enable-lora
    (and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, VLLM_SERVER_DEV_MODE=1) under `lora_name`."""
    url: Url
    """Base URL of that vLLM server (several runs' daemons may share one)."""
    lora_name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
    """The model name rollout workers ask vLLM for: it always serves this run's newest adapter."""
    timeout_s: float = Field(120.0, gt=0, le=86400)
    """Budget for one HTTP call to vLLM."""
    keep: int = Field(8, ge=2, le=1000)
    """Adapter directories kept under <state_dir>/lora/<lora_name> (the loaded one included).
    vLLM 0.32 re-reads an in-place-loaded adapter's directory while serving it, and a request
    started before a reload may still name an older one: deleting a directory in use kills
    vLLM's engine, so keep more than the versions a request can outlive."""


EngineHook = Annotated[NoHook | HttpHook | CommandHook | VllmHook | VllmLoraHook,
                       Field(discriminator="type")]


class AdapterConfig(_Section):
    """This daemon follows a LoRA run: its chain's versions are adapters over a base version
    held by another daemon on this host (chain/adapters.py)."""

    base_weights: Path
    """The weights directory (<state_dir>/weights) of the daemon that follows the base chain;
    an adapter version is applied only when its current version has the base digest it names."""
    run: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
    """The run this daemon serves (its manifests' `run`); another run's chain, even one signed
    with the same key, is then refused instead of being served under this run's name."""

    @field_validator("base_weights")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        if not v.is_absolute():
            raise ValueError(f"{v} must be an absolute path (the base daemon's "
                             "<state_dir>/weights)")
        return v


class Trajectories(_Section):
    upstream: Url | None = None
    """Where spooled trajectories go: the trainer's ingest URL (…/v1/ingest) or another daemon's
    …/v1/trajectories; null keeps them spooled (nothing is forwarded)."""
    upstream_token: str | None = Field(None, min_length=8, max_length=4096)
    """Bearer token for the upstream; default: this swarm's token."""
    spool_max_bytes: int = Field(256 << 20, ge=1 << 16, le=1 << 40)
    """Spool size at which new batches get 429 + Retry-After (back-pressure on workers)."""
    batch_size: int = Field(256, ge=1, le=100_000)
    """Most trajectories per forwarded request."""
    batch_max_bytes: int = Field(8 << 20, ge=1 << 12, le=1 << 30)
    """Most bytes per forwarded request."""
    retry_initial_s: float = Field(0.5, gt=0, le=60)
    """First retry delay after a failed forward; doubles up to retry_max_s, with jitter."""
    retry_max_s: float = Field(30.0, gt=0, le=3600)
    """Longest delay between forward attempts."""
    request_timeout_s: float = Field(30.0, gt=0, le=3600)
    """Timeout of one forward request."""

    @model_validator(mode="after")
    def _order(self) -> "Trajectories":
        if self.retry_max_s < self.retry_initial_s:
            raise ValueError("retry_max_s must be >= retry_initial_s")
        return self


class FleetConfig(_Section):
    report_to: list[Url] | None = Field(None, max_length=64)
    """Daemons this one sends its fleet report (and the ones it holds) to. Default (null): a
    region's member sends to its region's fetcher (the node that fetches new versions for the
    region; the bootstrap list too while that one does not take them), which sends its
    region's reports on to its bootstrap peers outside its region, else to the trainer; other
    nodes send to their bootstrap list. So the trainer answers a report per region, not per
    node (docs/SCALE.md 7)."""
    interval_s: float = Field(10.0, ge=1, le=3600)
    """Seconds between reports (jittered ±10 %); nodes older than 3x this show as stale."""
    forget_s: float = Field(120.0, ge=10, le=86_400)
    """A node not heard from for this long is dropped from the fleet board (and not forwarded)."""
    max_nodes: int = Field(20_000, ge=1, le=100_000)
    """Most nodes the fleet board holds (past it a newer report evicts the stalest entry)."""
    max_per_reporter: int = Field(2_000, ge=1, le=100_000)
    """Most entries one reporter may have forwarded onto this board (a region gateway's
    region, with room); its entries past it are refused (daemon/fleet/board.py)."""

    @field_validator("report_to")
    @classmethod
    def _roots(cls, urls: list[str] | None) -> list[str] | None:
        return None if urls is None else [_daemon_url(u) for u in urls]

    @model_validator(mode="after")
    def _forget_after_interval(self) -> "FleetConfig":
        if self.forget_s < 3 * self.interval_s:
            raise ValueError("forget_s must be >= 3 x interval_s (a node missing one report is "
                             "stale, not gone)")
        return self


class Config(_Section):
    node: str = Field(pattern=NODE_NAME)
    """This daemon's name (unique in the swarm; shown in status and logs)."""
    region: str = Field(pattern=NODE_NAME)
    """Region this daemon serves (trajectories are tagged by workers; shown in status)."""
    role: Literal["trainer", "region"]
    """`trainer`: seeds what the local publisher writes; `region`: follows the swarm."""
    state_dir: Path
    """Directory for chain, torrents, weights and spool; must exist and be writable."""
    http: HttpListen = HttpListen()
    """Control plane listen address."""
    bittorrent: BtListen = BtListen()
    """BitTorrent listen address and piece size."""
    bootstrap: list[Url] = Field(default_factory=list, max_length=1000)
    """Control-plane URLs of peers to learn heads from (one reachable peer is enough)."""
    trainer_public_key: str
    """The trainer's Ed25519 public key (64 hex digits); unsigned or foreign manifests are
    refused."""
    token: str | None = Field(None, min_length=8, max_length=4096)
    """Bearer token of the swarm (required on data and state-changing routes)."""
    token_file: Path | None = None
    """File holding the swarm's bearer token on its first line (at least 8 characters): one
    secret shared by every daemon, publisher, ingest and worker of the swarm. `deltaswarm init`
    writes one; or `python -c 'import secrets; print(secrets.token_urlsafe(24))' > FILE`."""
    limits: Limits = Limits()
    """Swarm bandwidth caps."""
    retention: RetentionConfig = RetentionConfig()
    """How many versions' artifacts and weight directories are kept."""
    bans: BanConfig = BanConfig()
    """Bans of peers that sent bad data (per endpoint and artifact, persisted)."""
    self_check: SelfCheckConfig = SelfCheckConfig()
    """Re-verification of the blocks this node serves."""
    sync: SyncConfig = SyncConfig()
    """When a region gives up on a download or an artifact nobody offers, and how long it
    gathers heads before planning (regions only)."""
    engine: EngineHook = NoHook()
    """The inference engine to notify after each verified version."""
    adapter: AdapterConfig | None = None
    """Set when this daemon follows a LoRA run's adapter chain (regions only)."""
    trajectories: Trajectories = Trajectories()
    """Where the spool forwards the trajectories workers post here."""
    long_poll_timeout_s: float = Field(30.0, gt=0, le=600)
    """Default and largest wait of a long-poll (head, weights) before it answers anyway."""
    seed_mode: bool = False
    """Trainer-side choking (few fast-rotating unchokes) so each piece leaves the seed ~once."""
    region_peering: RegionPeeringConfig = RegionPeeringConfig()
    """Which peers the swarm dials: region-aware (gateways) or blind."""
    max_peers: int = Field(32, ge=1, le=10_000)
    """Most peers whose heads are long-polled at once (bootstrap peers first), and the peer
    book's size beyond its anchors (each region's two first-ranked members and the trainers,
    kept so fetch roles and gateways agree in every view; daemon/peering/peers.py)."""
    shutdown_timeout_s: float = Field(20.0, gt=0, le=600)
    """Bound on a graceful stop (drain, save resume data, abandon an apply)."""
    fleet: FleetConfig = FleetConfig()
    """Fleet reports: where this daemon sends them and how often (daemon/fleet/board.py)."""

    @field_validator("bootstrap")
    @classmethod
    def _bootstrap_roots(cls, urls: list[str]) -> list[str]:
        return [_daemon_url(u) for u in urls]

    @field_validator("trainer_public_key")
    @classmethod
    def _hex_key(cls, v: str) -> str:
        v = v.strip().lower()
        if not re.fullmatch(r"[0-9a-f]{64}", v):
            raise ValueError("must be the trainer's Ed25519 public key as 64 hex digits (the "
                             "publisher's key file holds the private key; keys.public_hex of it)")
        return v

    @model_validator(mode="after")
    def _token_and_seed(self) -> "Config":
        one_token(self.token, self.token_file)
        if self.seed_mode and self.role != "trainer":
            raise ValueError("seed_mode is for role: trainer only")
        if self.engine.type == "vllm_lora" and self.adapter is None:
            raise ValueError("engine type vllm_lora loads LoRA adapters: set adapter.base_weights "
                             "to the base daemon's weights directory")
        return self

    def bearer(self) -> str:
        return bearer_token(self.token, self.token_file)

    def bt_advertise(self) -> str:
        return self.bittorrent.advertise_host or self.bittorrent.host


def load_config(path: str | os.PathLike, check_paths: bool = True) -> Config:
    """Parse and validate a daemon config; with `check_paths`, also require a writable
    state_dir and a readable token_file."""
    path = Path(path)
    cfg = load_yaml(Config, path, paths=("state_dir", "token_file"), tagged=("engine",))
    if check_paths:
        check_state_dir(cfg, path)
        try:
            cfg.bearer()
        except ConfigError as e:
            raise ConfigError(f"config {path}: field {e}") from None
    return cfg


def check_state_dir(cfg: Config, path: Path) -> None:
    d = cfg.state_dir
    if not d.is_dir():
        raise ConfigError(f"config {path}: field state_dir: {d} does not exist or is not a "
                          f"directory; create it (mkdir -p {d}) or fix the path")
    if not os.access(d, os.W_OK | os.X_OK):
        raise ConfigError(f"config {path}: field state_dir: {d} is not writable by this user "
                          f"(uid {os.getuid()}); fix its owner or permissions")
