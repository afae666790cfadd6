"""`deltaswarm status`: fetch a daemon's `GET /v1/status` and show it as rich tables, once or live.

    deltaswarm status [--url http://127.0.0.1:7600 | --config /etc/deltaswarm/REGION.yaml]
                      [--token T] [--peers] [--versions] [--fleet [--nodes]] [--json]
                      [--watch [--interval 2]]

From a config only `http.host`, `http.port`, `http.advertise_url`, `token` and `token_file` are
read. The token may also come from $DELTASWARM_TOKEN.
"""

import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from chain.textout import console as wide_console
from daemon.observe.status import NodeStatus
from daemon.observe.status_fleet import fleet_render

DEFAULT_URL = "http://127.0.0.1:7600"


class StatusError(RuntimeError):
    """The status could not be fetched or read; the message says which URL and what to check."""


def _human(n: float, suffix: str = "B") -> str:
    for unit in ("", "Ki", "Mi", "Gi", "Ti"):
        if abs(n) < 1024 or unit == "Ti":
            return f"{n:.0f} {unit}{suffix}" if unit == "" else f"{n:.1f} {unit}{suffix}"
        n /= 1024
    return ""


def _rate(n: float) -> str:
    return _human(n, "B/s")


def _ago(t: float | None, now: float) -> str:
    if t is None:
        return "never"
    d = max(0.0, now - t)
    if d < 120:
        return f"{d:.0f}s ago"
    return f"{d / 60:.0f}m ago" if d < 7200 else f"{d / 3600:.1f}h ago"


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 86400}d {s % 86400 // 3600}h" if s >= 86400 else (
        f"{s // 3600}h {s % 3600 // 60}m" if s >= 3600 else f"{s // 60}m {s % 60}s")


def _v(v: int | None) -> str:
    return "—" if v is None else str(v)


def _plain(text: str, style: str = "") -> Text:
    """A cell shown literally: names, addresses and reasons come from peers and must never be
    read as rich markup (a node named `[/oops]` would otherwise crash the render)."""
    return Text(text, style=style)


def summary(s: NodeStatus) -> Table:
    t = s.totals
    lag = "no version yet" if s.lag is None else str(s.lag)
    lag_style = "green" if s.lag == 0 else "yellow" if s.lag is not None and s.lag < 3 else "red"
    applied = (f"{_human(t.tensor_bytes)} tensors + {_human(t.file_bytes)} carried files "
               f"({_human(t.new_file_bytes)} of them changed) in {t.versions_applied} "
               f"version{'' if t.versions_applied == 1 else 's'}")
    saved = f"{_human(t.bytes_saved)} on tensors"
    if t.full_tensor_bytes:
        saved += (f" ({100 * t.bytes_saved / t.full_tensor_bytes:.1f}% of full checkpoints' "
                  f"tensors")
        saved += f", {t.smaller_on_tensors:.1f}x smaller)" if t.smaller_on_tensors else ")"
    v = s.verification
    fails = str(v.failures) + (f" (last: {v.last_error})" if v.last_error else "")
    refused = str(s.refused_total)
    if s.refused_manifests:
        last = s.refused_manifests[-1]
        refused += f" (last: {last.artifact or '?'} {last.kind}: {last.reason})"
    e = s.engine
    engine = f"{e.type or 'none'}: v{_v(e.last_version)}, {e.notifications} ok, {e.failures} failed"
    if e.last_error:
        engine += f" (last error: {e.last_error})"
    p = s.spool
    spool = (f"{p.depth} held ({_human(p.bytes)}), {p.forwarded} forwarded "
             f"({p.forward_rate:.1f}/s), {p.rejected_full} refused full")
    if p.last_error:
        spool += f" (last error: {p.last_error})"

    table = Table(title=_plain(f"deltaswarm {s.node} · {s.region} · {s.role}"), show_header=False,
                  title_justify="left", expand=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    table.add_row("version", f"{_v(s.current_version)} / head {_v(s.head_version)}")
    table.add_row("lag", Text(lag, style=lag_style))
    table.add_row("state digest", (s.state_digest or "—")[:16])
    table.add_row("uptime", _duration(s.uptime_s))
    table.add_row("rates", f"↓ {_rate(s.rates.download)}  ↑ {_rate(s.rates.upload)}")
    table.add_row("transferred", f"↓ {_human(t.bytes_down)}  ↑ {_human(t.bytes_up)}")
    table.add_row("applied", applied)
    table.add_row("saved", saved)
    table.add_row("peers", str(len(s.peers)))
    table.add_row("verify failures", _plain(fails, style="red" if v.failures else ""))
    table.add_row("bans", Text(str(len(s.bans)), style="red" if s.bans else ""))
    c = s.self_check
    table.add_row("self-check", _plain(
        f"{c.state}, {c.runs} passes, {_human(c.bytes_checked)} read, {c.corrupt_found} corrupt, "
        f"{c.repaired} repaired", style="red" if c.corrupt_found > c.repaired else ""))
    wc = s.weights_check
    if wc is not None:
        table.add_row("weights check", _plain(
            f"{wc.state}, {wc.runs} passes, {_human(wc.bytes_checked)} read, "
            f"{wc.damaged_found} damaged" + (" (off)" if not wc.enabled else ""),
            style="red" if wc.damaged_found else ""))
    w = s.warmup
    table.add_row("warm-up", _plain(w.state + (f" ({w.seconds:.1f}s)" if w.seconds else "")
                                    + (f": {w.error}" if w.error else "")))
    table.add_row("refused manifests", _plain(refused))
    ident = s.identity or {}
    if ident:
        last = (ident.get("refused") or [{}])[-1]
        claims = f"{ident.get('refused_total', 0)} refused name claims" + (
            f" (last: {last.get('node')} {last.get('fingerprint')} from {last.get('from')})"
            if last else "")
        table.add_row("identity", _plain(f"{ident.get('fingerprint')}, {claims}",
                                         style="red" if ident.get("refused_total") else ""))
    table.add_row("engine", _plain(engine))
    if s.engine_check is not None:
        table.add_row("engine check", _plain(*_engine_check_line(s)))
    table.add_row("spool", _plain(spool))
    return table


def _engine_check_line(s: NodeStatus) -> tuple[str, str]:
    """The vLLM backend's last update and its check, and when the whole read-back last ran."""
    c = s.engine_check
    assert c is not None
    verdict = {True: "ok", False: "MISMATCH", None: "unchecked"}[c.ok]
    line = (f"v{_v(c.last_version)} {c.mode or '-'} ({c.kind or '-'} check {verdict}, "
            f"{c.words} words); {c.mismatches} mismatches, {c.repairs} repaired")
    if c.reason:
        line += f"; {c.reason}"
    f = c.full_check
    if f:
        line += (f"; full read-back {time.strftime('%H:%M:%S', time.localtime(f['at']))} "
                 f"({f['why']}) v{f['version']}: "
                 f"{ {True: 'ok', False: 'MISMATCH', None: 'unreadable'}[f['ok']]}, "
                 f"{f['checked']} checked, {f['unreadable']} unreadable"
                 + (f", differ: {', '.join(f['mismatched'][:3])}" if f["mismatched"] else ""))
    else:
        line += "; full read-back: never (POST /v1/engine/check runs one)"
    bad = c.ok is False or (f and f.get("ok") is False)
    return line, "red" if bad else ""


def peers_table(s: NodeStatus) -> Table:
    table = Table(title="peers", title_justify="left")
    for col in ("node", "bittorrent", "http", "↓ bytes", "↑ bytes", "↓ rate", "↑ rate", "seen"):
        table.add_column(col, justify="right" if "bytes" in col or "rate" in col else "left")
    banned = {b.endpoint: b for b in s.bans}
    for p in sorted(s.peers, key=lambda p: (p.node or "", p.key)):
        style = "red" if p.bt_endpoint in banned else ""
        table.add_row(_plain(p.node or "?"), _plain(p.bt_endpoint or "—"),
                      _plain(p.http_url or "—"),
                      _human(p.bytes_down), _human(p.bytes_up), _rate(p.download_rate),
                      _rate(p.upload_rate), _ago(p.last_seen, s.time), style=style)
    for b in s.bans:
        table.add_row(_plain(b.node or "?"), _plain(b.endpoint), "", "", "", "", "",
                      _plain(f"banned on {b.artifact}: {b.reason}"), style="red")
    if not table.row_count:
        table.caption = "no peers known yet"
    return table


def versions_table(s: NodeStatus) -> Table:
    table = Table(title="versions", title_justify="left")
    for col in ("artifact", "state", "progress", "tensors", "files", "↓ rate", "↑ rate",
                "↑ bytes", "peers"):
        table.add_column(col, justify="left" if col in ("artifact", "state") else "right")
    styles = {"fetching": "cyan", "applying": "yellow", "current": "green", "seeding": "green",
              "failed": "red"}
    for t in s.versions:
        state = t.state + (f": {t.error}" if t.error else "")
        table.add_row(_plain(t.artifact), _plain(state, style=styles[t.state]),
                      f"{100 * t.progress:.1f}%",
                      _human(t.tensor_bytes), _human(t.file_bytes),
                      _rate(t.download_rate), _rate(t.upload_rate),
                      _human(t.bytes_up), str(t.peers))
    for r in s.refused_manifests:
        table.add_row(_plain(r.artifact or "?"),
                      _plain(f"refused {r.kind}: {r.reason}", style="red"),
                      "", "", "", "", "", "", "")
    if not table.row_count:
        table.caption = "no transfers"
    return table


def render(s: NodeStatus, peers: bool = False, versions: bool = False) -> Group:
    parts: list = [summary(s)]
    if peers:
        parts.append(peers_table(s))
    if versions:
        parts.append(versions_table(s))
    return Group(*parts)


def _get(target: str, token: str | None, timeout: float) -> bytes:
    """GET `target` with the token; StatusError saying what to check."""
    req = urllib.request.Request(target, headers={"Accept": "application/json"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.read()
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            raise StatusError(f"{target} refused the request (HTTP {e.code}): pass the swarm's "
                              "token with --token, $DELTASWARM_TOKEN or --config") from None
        detail = e.read()[:200].decode(errors="replace")
        raise StatusError(f"{target} answered HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise StatusError(
            f"cannot reach the deltaswarm daemon at {target}: {reason}. Is it running "
            "(systemctl status 'deltaswarm-daemon@*') and listening there? Point at it with "
            "--url http://HOST:PORT or --config /etc/deltaswarm/REGION.yaml") from None


def fetch(url: str, token: str | None, timeout: float = 5.0) -> tuple[dict, NodeStatus]:
    """GET {url}/v1/status -> (raw JSON, parsed). Raises StatusError saying what to check."""
    target = url.rstrip("/") + "/v1/status"
    body = _get(target, token, timeout)
    try:
        raw = json.loads(body)
        return raw, NodeStatus.model_validate(raw)
    except (ValueError, ValidationError) as e:
        raise StatusError(f"{target} did not return a deltaswarm status: {e}") from None


def fetch_fleet(url: str, token: str | None, timeout: float = 10.0, nodes: bool = True) -> dict:
    """GET {url}/v1/fleet -> the fleet view (daemon/fleet/board.py); `nodes=False` asks for the
    per-region summary only (`?nodes=0`: kilobytes instead of megabytes at 10k nodes). Raises
    StatusError."""
    target = url.rstrip("/") + "/v1/fleet" + ("" if nodes else "?nodes=0")
    try:
        doc = json.loads(_get(target, token, timeout))
    except ValueError as e:
        raise StatusError(f"{target} did not return JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("regions"), dict):
        raise StatusError(f"{target} did not return a deltaswarm fleet view (an older daemon "
                          "without /v1/fleet?)")
    return doc


def from_config(path: Path) -> tuple[str, str | None]:
    """(url, token) from a daemon config's http and token fields."""
    import yaml

    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise StatusError(f"cannot read config {path}: {e}") from None
    if not isinstance(doc, dict):
        raise StatusError(f"config {path}: expected a mapping at the top level")
    http = doc.get("http") if isinstance(doc.get("http"), dict) else {}
    url = http.get("advertise_url")
    if not url:
        host = str(http.get("host", "127.0.0.1"))
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        url = f"http://{f'[{host}]' if ':' in host else host}:{http.get('port', 7600)}"
    token = doc.get("token")
    if not token and doc.get("token_file"):
        tf = Path(os.path.expanduser(str(doc["token_file"])))
        tf = tf if tf.is_absolute() else path.parent / tf
        try:
            token = tf.read_text().strip().splitlines()[0].strip()
        except (OSError, IndexError) as e:
            raise StatusError(f"config {path}: cannot read token_file {tf}: {e}") from None
    return url, token


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="deltaswarm status", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help=f"daemon control-plane URL (default {DEFAULT_URL})")
    ap.add_argument("--config", type=Path, help="take URL and token from this daemon config")
    ap.add_argument("--token", help="bearer token (default $DELTASWARM_TOKEN or the config's)")
    ap.add_argument("--peers", action="store_true", help="one line per peer (and bans)")
    ap.add_argument("--versions", action="store_true",
                    help="one line per version transfer (and refused manifests)")
    ap.add_argument("--fleet", action="store_true",
                    help="the whole fleet as this daemon knows it (GET /v1/fleet): each region, "
                    "its nodes, versions, lag, bytes per link class, trajectories waiting")
    ap.add_argument("--nodes", action="store_true",
                    help="with --fleet: one line per node too (by default one per region)")
    ap.add_argument("--json", action="store_true", help="print the raw JSON and exit")
    ap.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    ap.add_argument("--count", type=int, default=0,
                    help="with --watch: stop after this many refreshes (0 = until Ctrl-C)")
    args = ap.parse_args(argv)
    if args.interval <= 0:
        ap.error("--interval must be > 0")
    return args


def watch(args: argparse.Namespace, url: str, token: str | None, console: Console) -> int:
    def frame():
        try:
            if args.fleet:
                return fleet_render(fetch_fleet(url, token, nodes=args.nodes), args.nodes)
            return render(fetch(url, token)[1], args.peers, args.versions)
        except StatusError as e:
            return Panel(Text(str(e), style="red"),
                         title=f"{time.strftime('%H:%M:%S')} retrying every {args.interval:g}s")

    # Ctrl-C sets a flag the loop checks between frames instead of raising KeyboardInterrupt
    # wherever the main thread happens to be (inside rich's locks or a socket read it could
    # leave the process hung: seen twice in CI, the CLI alive 30 s after SIGINT).
    stop = threading.Event()
    on_main = threading.current_thread() is threading.main_thread()  # only it sets handlers
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set()) if on_main else None
    n = 0
    try:
        with Live(frame(), console=console, auto_refresh=False) as live:
            while not stop.is_set():
                n += 1
                if args.count and n >= args.count:
                    return 0
                if stop.wait(args.interval):
                    break
                live.update(frame(), refresh=True)
        return 0
    except KeyboardInterrupt:  # a SIGINT before the handler was set
        return 0
    finally:
        if on_main:
            signal.signal(signal.SIGINT, previous)


def main(argv: list[str] | None = None, console: Console | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    console = console or wide_console()
    try:
        url, token = from_config(args.config) if args.config else (DEFAULT_URL, None)
    except StatusError as e:
        print(f"deltaswarm status: {e}", file=sys.stderr)
        return 2
    url = args.url or url
    token = args.token or os.environ.get("DELTASWARM_TOKEN") or token
    if args.watch and not args.json:
        return watch(args, url, token, console)
    try:
        if args.fleet:
            raw = fetch_fleet(url, token, nodes=args.nodes)
        else:
            raw, status = fetch(url, token)
    except StatusError as e:
        print(f"deltaswarm status: {e}", file=sys.stderr)
        return 1
    if args.fleet and not args.json:
        console.print(fleet_render(raw, args.nodes))
    elif args.json:
        print(json.dumps(raw, indent=2, sort_keys=True))
    else:
        console.print(render(status, args.peers, args.versions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
