"""The Grafana dashboard's structure (ops/grafana/deltaswarm-dashboard.json), what Grafana would
otherwise reject or show broken on import: unique panel ids, panels inside the 24-column grid
and not overlapping, every query on the `$datasource` variable, every `$variable` a query uses
defined, and both halves the issue asks for present (the fleet, one node). Whether the metrics
exist and the queries parse is checked against a real daemon and promtool in
tests/integration/test_operator_view.py."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = json.loads((ROOT / "ops" / "grafana" / "deltaswarm-dashboard.json").read_text())
BUILTIN = {"__rate_interval", "__interval", "__range"}


def test_panels_have_unique_ids_and_fit_the_grid_without_overlap() -> None:
    panels = DASHBOARD["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    taken: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                 for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"{p['title']} overlaps another panel"
        taken |= cells


def test_every_query_uses_the_datasource_variable_and_defined_variables() -> None:
    defined = {v["name"] for v in DASHBOARD["templating"]["list"]} | BUILTIN
    targets = [t for p in DASHBOARD["panels"] for t in p.get("targets", [])]
    assert len(targets) >= 30
    for t in targets:
        assert t["datasource"]["uid"] == "${datasource}"
        used = set(re.findall(r"\$(\w+)", t["expr"]))
        assert used <= defined, (t["expr"], used - defined)
    refs = [t["refId"] for p in DASHBOARD["panels"] for t in p.get("targets", [])]
    assert all(refs), "every target needs a refId"


def test_fleet_overview_and_node_detail_are_both_there() -> None:
    titles = " | ".join(p["title"] for p in DASHBOARD["panels"]).lower()
    for want in ("version per region", "lag per region", "publish → current latency",
                 "link class", "trainer egress", "apply time", "engine serve time",
                 "trajectory spool", "bans", "self-check"):
        assert want in titles, want
