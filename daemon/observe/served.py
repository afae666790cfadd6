"""What this daemon's HTTP API sends, per route: responses and body bytes.

Why: the trainer's daemon must not become the fleet's bottleneck (docs/SCALE.md): manifests,
torrents, indexes and head replies that every node fetches from it grow with the fleet unless
nodes take them from their own region. These counters show who pays for the control plane
(`deltaswarm_http_response_bytes_total{route="/v1/chain/manifests/{artifact}"}`) and are what
bench/scaleout.py measures per version. Bodies are counted from the length each response
declares when it is prepared (every route here declares one); headers are not counted.
"""

from collections import Counter
from collections.abc import Iterator

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector


class ServedBytes(Collector):
    """Counts responses and body bytes per route; `attach(app)` hooks it to an app."""

    def __init__(self) -> None:
        self.responses: Counter[str] = Counter()
        self.body_bytes: Counter[str] = Counter()

    def attach(self, app: web.Application) -> None:
        app.on_response_prepare.append(self._prepared)

    async def _prepared(self, request: web.Request, response: web.StreamResponse) -> None:
        route = request.match_info.route.resource
        name = route.canonical if route is not None else "unmatched"
        self.responses[name] += 1
        self.body_bytes[name] += response.content_length or 0

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {r: {"responses": self.responses[r], "body_bytes": self.body_bytes[r]}
                for r in sorted(self.responses)}

    def collect(self) -> Iterator[Metric]:
        n = CounterMetricFamily("deltaswarm_http_responses", "HTTP responses sent, per route",
                                labels=["route"])
        b = CounterMetricFamily("deltaswarm_http_response_bytes",
                                "HTTP response body bytes sent, per route", labels=["route"])
        for route in sorted(self.responses):
            n.add_metric([route], self.responses[route])
            b.add_metric([route], self.body_bytes[route])
        yield n
        yield b


def route_counts(text: str, family: str) -> dict[str, float]:
    """route → value of this module's counter `family` (`deltaswarm_http_responses` or
    `deltaswarm_http_response_bytes`) in a daemon's /metrics text: what benches and tests read."""
    return {s.labels["route"]: s.value for fam in text_string_to_metric_families(text)
            if fam.name == family for s in fam.samples if s.name.endswith("_total")}
