"""`deltaswarm status --fleet`: the fleet view (`GET /v1/fleet`, daemon/fleet/board.py) as rich
tables: one line per region (what an operator reads when a region falls behind), and with
`--nodes` one line per node as well. By default only the per-region summary is fetched
(`?nodes=0`) and shown: at 20,000 nodes the node table took 19-26 s to print (issue 20,
finding 10), the summary is a few hundred rows at most.

Names, URLs and refusal reasons come from other nodes: every such cell is plain `Text`, never
rich markup.
"""

from rich.console import Group
from rich.table import Table
from rich.text import Text


def _b(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _v(v: object) -> str:
    return "—" if v is None else str(v)


def _s(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:.0f}s" if v < 120 else f"{v / 60:.0f}m" if v < 7200 else f"{v / 3600:.1f}h"


def _lag_style(lag: int | None) -> str:
    return "green" if lag == 0 else "yellow" if lag is not None and lag < 3 else "red"


def _flow(links: dict, cls: str) -> str:
    f = links.get(cls) or {}
    return f"{_b(f.get('bytes_in', 0))} / {_b(f.get('bytes_out', 0))}"


def regions_table(view: dict) -> Table:
    t = Table(title=Text(f"fleet seen from {view.get('node')} · head v{_v(view.get('head'))} · "
                         f"{view.get('nodes', 0)} nodes"), title_justify="left")
    for col in ("region", "nodes", "at head", "stale", "versions", "max lag", "max lag s",
                "cross in/out", "intra in/out", "trainer in/out", "trajectories"):
        t.add_column(col, justify="left" if col == "region" else "right")
    for name, r in sorted(view.get("regions", {}).items()):
        lo, hi = r.get("min_version"), r.get("max_version")
        versions = _v(lo) if lo == hi else f"{_v(lo)}–{_v(hi)}"
        lag = r.get("max_lag_versions")
        t.add_row(Text(name), str(r.get("node_count", 0)), str(r.get("at_head", 0)),
                  Text(str(r.get("stale", 0)), style="red" if r.get("stale") else ""),
                  versions, Text(_v(lag), style=_lag_style(lag)), _s(r.get("max_lag_s")),
                  _flow(r.get("links", {}), "cross"), _flow(r.get("links", {}), "intra"),
                  _flow(r.get("links", {}), "trainer"), str(r.get("trajectories_waiting", 0)))
    if not t.row_count:
        t.caption = "no reports yet"
    elif view.get("refused"):
        t.caption = Text(f"{view['refused']} report entries refused (last: "
                         f"{view.get('last_refusal')})", style="red")
    return t


def nodes_table(view: dict) -> Table:
    t = Table(title="nodes", title_justify="left")
    for col in ("region", "node", "role", "version", "held for", "lag", "lag s", "seen",
                "cross in/out", "intra in/out", "trainer in/out", "trajectories", "via"):
        t.add_column(col, justify="left" if col in ("region", "node", "role", "via")
                     else "right")
    now = view.get("time") or 0.0
    for region, r in sorted(view.get("regions", {}).items()):
        for n in r.get("nodes", []):
            since = n.get("since")
            lag = n.get("lag_versions")
            seen = "self" if n.get("self") else f"{_s(n.get('age_s'))} ago"
            t.add_row(Text(region), Text(n.get("node", "?")), Text(n.get("role", "?")),
                      _v(n.get("version")), _s(None if since is None else now - since),
                      Text(_v(lag), style=_lag_style(lag)), _s(n.get("lag_s")),
                      Text(seen, style="red" if n.get("stale") else ""),
                      _flow(n.get("links", {}), "cross"), _flow(n.get("links", {}), "intra"),
                      _flow(n.get("links", {}), "trainer"), str(n.get("trajectories_waiting", 0)),
                      Text(n.get("via") or "direct"))
    return t


def fleet_render(view: dict, nodes: bool = False) -> Group:
    """The region table, and with `nodes` the node table (from a view that has node lists)."""
    if not nodes:
        return Group(regions_table(view))
    return Group(regions_table(view), nodes_table(view))
