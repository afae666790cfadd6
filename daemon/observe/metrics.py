"""Prometheus exposition of a node's `NodeStatus`: a custom collector that reads a fresh snapshot
at each scrape, registered in a private `CollectorRegistry` per node (never the global one, so
several nodes can live in one process), and an aiohttp handler for `GET /metrics` that honours
the scraper's Accept header (text format or OpenMetrics).

`/metrics` is open (no token), so by default it shows only this node's own identity and
aggregates: no peer addresses or peer node names (THREAT_MODEL.md). Per-peer series are added
only for a scrape that presents the swarm's bearer token (Prometheus `authorization:`).
"""

from collections.abc import Awaitable, Callable, Iterator

from aiohttp import web
from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from chain.auth import bearer_matches
from daemon.observe.status import TRANSFER_STATES, NodeStatus

StatusSource = Callable[[], NodeStatus]


def _gauge(name: str, doc: str, value: float | None, unit: str = "") -> Iterator[Metric]:
    if value is not None:
        yield GaugeMetricFamily(f"deltaswarm_{name}", doc, value=value, unit=unit)


def _counter(name: str, doc: str, value: float) -> Metric:
    return CounterMetricFamily(f"deltaswarm_{name}", doc, value=value)


class StatusCollector(Collector):
    """Turns `source()` into metric families on every collect(); `peers` adds the per-peer
    series (labelled by peer address and node name), for authenticated scrapes only."""

    def __init__(self, source: StatusSource, peers: bool = False):
        self.source = source
        self.peers = peers

    def collect(self) -> Iterator[Metric]:
        s = self.source()
        yield InfoMetricFamily(
            "deltaswarm_node", "Identity of this node",
            value={"node": s.node, "region": s.region, "role": s.role},
        )
        yield from _gauge("uptime_seconds", "Seconds since the daemon started", s.uptime_s)
        yield from _gauge("current_version", "Version this node holds, verified", s.current_version)
        yield from _gauge("head_version", "Newest version this node knows of", s.head_version)
        yield from _gauge("lag_versions", "head_version - current_version", s.lag)
        yield from _gauge("download_bytes_per_second", "Swarm download rate", s.rates.download)
        yield from _gauge("upload_bytes_per_second", "Swarm upload rate", s.rates.upload)
        yield from self._transfers(s)
        yield from self._peers(s)
        yield from self._totals(s)
        yield from self._health(s)
        yield from self._engine(s)
        yield from self._spool(s)

    def _transfers(self, s: NodeStatus) -> Iterator[Metric]:
        lab = ["artifact"]
        state = GaugeMetricFamily(
            "deltaswarm_transfer_state", "1 for the artifact's current state",
            labels=["artifact", "state"],
        )
        done = GaugeMetricFamily("deltaswarm_transfer_done_bytes", "Bytes held", labels=lab)
        size = GaugeMetricFamily("deltaswarm_transfer_size_bytes", "Artifact size", labels=lab)
        tensors = GaugeMetricFamily("deltaswarm_transfer_tensor_bytes",
                                    "Of the artifact's size, the tensor payload", labels=lab)
        files = GaugeMetricFamily("deltaswarm_transfer_carried_file_bytes",
                                  "Of the artifact's size, the carried files", labels=lab)
        down = GaugeMetricFamily(
            "deltaswarm_transfer_download_bytes_per_second", "Download rate", labels=lab
        )
        up = GaugeMetricFamily(
            "deltaswarm_transfer_upload_bytes_per_second", "Upload rate", labels=lab
        )
        sent = CounterMetricFamily(
            "deltaswarm_transfer_sent_bytes", "Bytes of the artifact uploaded", labels=lab
        )
        peers = GaugeMetricFamily("deltaswarm_transfer_peers", "Peers connected", labels=lab)
        for t in s.versions:
            for st in TRANSFER_STATES:
                state.add_metric([t.artifact, st], 1.0 if t.state == st else 0.0)
            done.add_metric([t.artifact], t.done_bytes)
            size.add_metric([t.artifact], t.total_bytes)
            tensors.add_metric([t.artifact], t.tensor_bytes)
            files.add_metric([t.artifact], t.file_bytes)
            down.add_metric([t.artifact], t.download_rate)
            up.add_metric([t.artifact], t.upload_rate)
            sent.add_metric([t.artifact], t.bytes_up)
            peers.add_metric([t.artifact], t.peers)
        yield from (state, done, size, tensors, files, down, up, sent, peers)

    def _peers(self, s: NodeStatus) -> Iterator[Metric]:
        yield from _gauge("peers", "Peers this node knows", len(s.peers))
        if not self.peers:
            return
        lab = ["peer", "peer_node"]
        sent = CounterMetricFamily("deltaswarm_peer_sent_bytes", "Bytes sent to peer", labels=lab)
        recv = CounterMetricFamily(
            "deltaswarm_peer_received_bytes", "Bytes received from peer", labels=lab
        )
        seen = GaugeMetricFamily(
            "deltaswarm_peer_last_seen_timestamp_seconds", "Last contact (unix time)", labels=lab
        )
        for p in s.peers:
            key = [p.key, p.node or ""]
            sent.add_metric(key, p.bytes_up)
            recv.add_metric(key, p.bytes_down)
            if p.last_seen is not None:
                seen.add_metric(key, p.last_seen)
        yield from (sent, recv, seen)

    def _totals(self, s: NodeStatus) -> Iterator[Metric]:
        t = s.totals
        yield _counter("sent_bytes", "Bytes uploaded to peers", t.bytes_up)
        yield _counter("received_bytes", "Bytes downloaded from peers", t.bytes_down)
        yield _counter("tensor_bytes", "Tensor payload bytes of the applied versions",
                       t.tensor_bytes)
        yield _counter("full_tensor_bytes", "The same versions' tensors uncompressed (what full "
                       "checkpoints' tensors weigh)", t.full_tensor_bytes)
        yield _counter("carried_file_bytes", "Carried files (config, tokenizer, ...) the applied "
                       "versions list, once per version", t.file_bytes)
        yield _counter("new_carried_file_bytes", "Of carried_file_bytes, those not in the version "
                       "applied before (the rest: blocks held, not fetched again)",
                       t.new_file_bytes)
        yield _counter("payload_bytes", "tensor_bytes + carried_file_bytes", t.payload_bytes)
        yield _counter("full_checkpoint_bytes", "full_tensor_bytes + carried_file_bytes",
                       t.full_bytes)
        yield from _gauge("saved_bytes", "full_tensor_bytes - tensor_bytes (on tensors)",
                          t.bytes_saved)
        yield _counter("versions_applied", "Versions applied and verified", t.versions_applied)

    def _health(self, s: NodeStatus) -> Iterator[Metric]:
        fails = CounterMetricFamily(
            "deltaswarm_verification_failures", "Data failing a check, by kind", labels=["kind"]
        )
        for kind, n in sorted(s.verification.failures_by_kind.items()):
            fails.add_metric([kind], n)
        refused = CounterMetricFamily(
            "deltaswarm_refused_manifests", "Manifests refused, by kind", labels=["kind"]
        )
        for kind, n in sorted(s.refused_by_kind.items()):
            refused.add_metric([kind], n)
        yield fails
        yield refused
        yield from _gauge("banned_peers", "Bad-data bans in force, one per (peer endpoint, "
                          "artifact)", len(s.bans))
        c = s.self_check
        yield _counter("self_check_bytes", "Bytes of served blocks re-read and hashed",
                       c.bytes_checked)
        yield _counter("self_check_corrupt_blocks", "Served blocks found corrupt on disk",
                       c.corrupt_found)
        yield _counter("self_check_repaired_blocks", "Corrupt blocks refetched and verified",
                       c.repaired)
        yield from _gauge("self_check_last_run_timestamp_seconds", "When the last pass ended",
                          c.last_run_at)
        yield from _gauge("warmup_ready", "1 once the codec kernels are compiled",
                          1.0 if s.warmup.state == "ready" else 0.0)
        yield from _gauge("warmup_seconds", "How long compiling the codec kernels took",
                          s.warmup.seconds)
        yield from _gauge("weights_problem", "1 if the start-up or scheduled check found the "
                          "stored weights damaged (see /v1/status weights_problem)",
                          float(s.weights_problem is not None))
        w = s.weights_check
        if w is not None:
            yield _counter("weights_check_bytes", "Bytes of stored weights re-read and hashed",
                           w.bytes_checked)
            yield _counter("weights_check_damaged_versions", "Weight directories found "
                           "damaged by the scheduled check and set aside", w.damaged_found)
            yield from _gauge("weights_check_last_run_timestamp_seconds",
                              "When the last check of the stored weights ended", w.last_run_at)
        yield from _gauge("apply_seconds", "Last version's apply, verified", s.last_apply_s)

    def _engine(self, s: NodeStatus) -> Iterator[Metric]:
        e = s.engine
        yield _counter("engine_notifications", "Successful engine notifications", e.notifications)
        yield _counter("engine_notification_failures", "Failed engine notifications", e.failures)
        yield from _gauge("engine_version", "Last version the engine took", e.last_version)
        yield from _gauge(
            "engine_last_ok_timestamp_seconds", "Last successful notification", e.last_ok_at
        )
        c = s.engine_check
        if c is None:
            return
        yield _counter("engine_checks", "Read-backs of the engine's weights after an update",
                       c.checks)
        yield _counter("engine_check_mismatches",
                       "Read-backs that found the live weights differ from the version",
                       c.mismatches)
        yield _counter("engine_repairs", "Full reloads after a mismatch that then verified",
                       c.repairs)
        yield _counter("engine_repair_failures", "Full reloads that still differed",
                       c.repair_failures)
        yield from _gauge("engine_check_ok", "1 if the last check matched, 0 if it did not",
                          None if c.ok is None else float(c.ok))
        yield from _gauge("engine_checked_tensors", "Tensors verified by the last check",
                          c.checked)
        yield from _gauge("engine_unreadable_tensors",
                          "Tensors the engine could not read back at the last check", c.unreadable)
        yield from _gauge("engine_update_seconds", "Last engine update, pause to resume",
                          c.update_s)
        yield from _gauge("engine_check_seconds", "Last read-back", c.check_s)

    def _spool(self, s: NodeStatus) -> Iterator[Metric]:
        p = s.spool
        yield from _gauge("spool_depth", "Trajectories held, not yet acknowledged", p.depth)
        yield from _gauge("spool_bytes", "Bytes held in the spool", p.bytes)
        yield _counter("spool_received", "Trajectories accepted from workers", p.received)
        yield _counter("spool_forwarded", "Trajectories acknowledged upstream", p.forwarded)
        yield _counter("spool_rejected_full", "Posts refused with 429", p.rejected_full)
        yield _counter("spool_forward_errors", "Failed forwarding attempts", p.errors)
        yield _counter("spool_rejected_invalid",
                       "Trajectories the upstream refused as invalid (set aside)",
                       p.rejected_invalid)
        yield from _gauge(
            "spool_forward_per_second", "Trajectories acknowledged per second", p.forward_rate
        )


def build_registry(source: StatusSource, peers: bool = False) -> CollectorRegistry:
    """A private registry holding only this node's collector; `peers` only behind the token."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(source, peers=peers))
    return registry


def render(registry: CollectorRegistry, accept: str = "") -> tuple[bytes, str]:
    """(body, content type) for the format the Accept header asks for."""
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type


def metrics_handler(
    source: StatusSource | CollectorRegistry, token: Callable[[], str] | str | None = None,
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An aiohttp handler for `GET /metrics` over a status source (or a ready registry). With
    `token` (the swarm token, or a function returning the current one), a scrape carrying
    `Authorization: Bearer <token>` also gets the per-peer series; any other scrape does not."""
    if isinstance(source, CollectorRegistry):
        public = detailed = source
    else:
        public, detailed = build_registry(source), build_registry(source, peers=True)

    async def handle(request: web.Request) -> web.Response:
        want = token() if callable(token) else token
        authed = want is not None and bearer_matches(request.headers.get("Authorization"), want)
        body, content_type = render(detailed if authed else public,
                                    request.headers.get("Accept", ""))
        return web.Response(body=body, headers={"Content-Type": content_type})

    return handle


MAX_FLEET_REGIONS = 1000
"""Regions exported per scrape (sorted by name); label cardinality is per region, never per
node: 100 regions x ~17 series = ~1,700 series however many nodes each region has."""


class FleetCollector(Collector):
    """Per-region series from the fleet view (daemon/fleet/board.py), for authenticated scrapes
    only:
    region names and node counts are the operator's, not for anonymous scrapers."""

    def __init__(self, view: Callable[[], dict]):
        self.view = view

    def collect(self) -> Iterator[Metric]:
        v = self.view()
        regions = sorted(v.get("regions", {}).items())[:MAX_FLEET_REGIONS]

        def fam(name: str, doc: str, key: str) -> Metric:
            g = GaugeMetricFamily(f"deltaswarm_fleet_{name}", doc, labels=["region"])
            for region, r in regions:
                if r.get(key) is not None:
                    g.add_metric([region], r[key])
            return g

        yield fam("nodes", "Nodes reporting (fresh and stale)", "node_count")
        yield fam("stale_nodes", "Nodes not heard from within 3 report intervals", "stale")
        yield fam("nodes_at_head", "Fresh nodes holding this daemon's head", "at_head")
        yield fam("min_version", "Oldest version a fresh node holds", "min_version")
        yield fam("max_lag_versions", "Versions the furthest-behind fresh node lacks",
                  "max_lag_versions")
        yield fam("max_lag_seconds", "Seconds the furthest-behind fresh node has been behind",
                  "max_lag_s")
        yield fam("trajectories_waiting", "Trajectories spooled, not yet acknowledged",
                  "trajectories_waiting")
        links = GaugeMetricFamily(
            "deltaswarm_fleet_link_bytes", "Bytes moved since each node started, summed over "
            "the region's nodes, by link class (intra|cross|trainer|unknown) and direction",
            labels=["region", "link_class", "direction"])
        for region, r in regions:
            for cls, flow in sorted(r.get("links", {}).items()):
                links.add_metric([region, cls, "in"], flow.get("bytes_in", 0))
                links.add_metric([region, cls, "out"], flow.get("bytes_out", 0))
        yield links
        yield CounterMetricFamily("deltaswarm_fleet_refused_entries",
                                  "Fleet report entries refused", value=v.get("refused", 0))


def render_fleet(view: Callable[[], dict], accept: str = "") -> tuple[bytes, str]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(view))
    return render(registry, accept)
