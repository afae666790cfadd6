"""The operator's view against a real cluster (a trainer and regions `east` and `west`, real
daemons on loopback): every metric the alert rules and the Grafana dashboard name is one a real
daemon exports (scraped open and with the token), the dashboard's queries parse (promtool), and
the live fleet page (`GET /ui`) in a real headless Chromium shows every region, takes the token
without putting it in a URL, logs no console errors and shows a new version after a publish."""

import asyncio
import base64
import hashlib
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.browser import CHROMIUM, Browser
from tests.integration.harness import ROOT, TOKEN, Cluster, http, step, tiny_model
from tests.support import async_wait_until

RULES = ROOT / "ops" / "prometheus" / "deltaswarm-rules.yml"
DASHBOARD = ROOT / "ops" / "grafana" / "deltaswarm-dashboard.json"
FLEET = {"interval_s": 1, "forget_s": 60}
ALLOWED_ABSENT = {
    "up": "Prometheus's own per-target series, not a daemon's",
    **{f"deltaswarm_{n}": "exported only by a daemon whose engine hook is the vLLM backend hook "
       "(engine_check in /v1/status; tests/integration/test_vllm_backend_hook.py runs one)"
       for n in ("engine_check_ok", "engine_check_mismatches_total",
                 "engine_repair_failures_total", "engine_update_seconds",
                 "engine_check_seconds")},
}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                "unless", "bool", "offset", "inf", "nan"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root: Path = tmp_path_factory.mktemp("operator")
    with Cluster(root) as c:
        c.trainer(fleet=FLEET)
        c.region("r1", region="east", fleet=FLEET)
        c.region("r2", region="west", fleet=FLEET)
        c.start_all()
        c.state = tiny_model(0)  # type: ignore[attr-defined]
        c.publish(0, c.state)  # type: ignore[attr-defined]
        c.wait_all_at(0, 200)  # generous: three daemons compile their codec kernels at start
        yield c


# --- metric names ---------------------------------------------------------------------------
def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left once strings, label matchers,
    ranges, grouping clauses and function calls are removed."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        rest = e[m.end():].lstrip()
        if rest.startswith("(") or m.group() in PROMQL_WORDS:
            continue  # a function or aggregation, or a keyword
        if re.fullmatch(r"[0-9]*[smhdwy]", m.group()) or e[m.start() - 1:m.start()] == "$":
            continue
        names.add(m.group())
    return names


def rule_exprs() -> list[str]:
    doc = yaml.safe_load(RULES.read_text())
    return [r["expr"] for g in doc["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    out = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    # Grafana's label_values(<selector>, <label>): the selector is PromQL, the label is not
    out += [re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", v["definition"])
            for v in doc["templating"]["list"] if v.get("definition")]
    return out


def exported(text: str) -> set[str]:
    """Names PromQL can select in a scrape: every sample's name, and for a family with no
    samples yet its name as PromQL sees it (`_total` for a counter, `_info` for an info)."""
    names = set()
    for fam in text_string_to_metric_families(text):
        names |= {s.name for s in fam.samples}
        names.add(fam.name + {"counter": "_total", "info": "_info"}.get(fam.type, ""))
    return names


def scrape(url: str, token: str | None) -> str:
    code, body, _ = http(f"{url}/metrics", token=token)
    assert code == 200, body[:300]
    return body.decode()


def test_the_name_parser_finds_metrics_and_skips_functions_labels_and_keywords() -> None:
    expr = ('sum by (region) (rate(deltaswarm_x_total{job="a",le="up"}[5m])) * on (instance) '
            'group_left (node) deltaswarm_node_info{role="trainer"} > 3 and up == 0 or '
            "time() - deltaswarm_y[$__rate_interval] offset 5m")
    assert metric_names(expr) == {"deltaswarm_x_total", "deltaswarm_node_info", "up",
                                  "deltaswarm_y"}


def test_every_metric_the_rules_and_dashboard_use_is_exported_by_a_real_daemon(
        cluster: Cluster) -> None:
    trainer, r1 = cluster.daemons["trainer"], cluster.daemons["r1"]
    have = set()
    for d in (trainer, r1):
        have |= exported(scrape(d.url, TOKEN))
    open_r1 = exported(scrape(r1.url, None))
    assert not {n for n in open_r1 if n.startswith("deltaswarm_fleet_")}, \
        "fleet series need the token"
    used = {n: src for src, exprs in (("rules", rule_exprs()), ("dashboard", dashboard_exprs()))
            for e in exprs for n in metric_names(e)}
    assert len(used) >= 40, sorted(used)
    missing = {n: src for n, src in used.items() if n not in have and n not in ALLOWED_ABSENT}
    assert not missing, f"used but not exported by a real daemon: {missing}"
    source = (ROOT / "daemon" / "observe" / "metrics.py").read_text()
    for name in ALLOWED_ABSENT:
        if name.startswith("deltaswarm_"):
            base = name.removeprefix("deltaswarm_").removesuffix("_total")
            assert f'"{base}"' in source, (
                f"{name} is allowlisted but daemon/observe/metrics.py lacks it")
    # the two series this issue added, on a region that applied a version
    r1_text = scrape(r1.url, None)
    assert re.search(r"^deltaswarm_weights_problem 0\.0$", r1_text, re.M)
    assert re.search(r"^deltaswarm_apply_seconds [0-9.e-]+$", r1_text, re.M)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian: "
                    "apt-get install prometheus; .ci/run installs it)")
def test_the_dashboard_queries_parse(tmp_path: Path) -> None:
    """promtool parses each dashboard query as a recording rule (Grafana's variables filled)."""
    subst = {"$__rate_interval": "5m", "$fleet": "t:1", "$instance": "r1:1"}
    rules = []
    for i, e in enumerate(dashboard_exprs()):
        for k, v in subst.items():
            e = e.replace(k, v)
        rules.append({"record": f"dashboard:q{i}", "expr": e})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# --- the live page --------------------------------------------------------------------------
VERSIONS_JS = """JSON.stringify(Object.fromEntries([...document.querySelectorAll('tr[data-node]')]
    .map(r => [r.dataset.node, r.querySelector('.version').textContent])))"""
SHOWN_JS = "(id => getComputedStyle(document.getElementById(id)).display !== 'none')"
REGIONS_JS = "[...document.querySelectorAll('section[data-region]')].map(e => e.dataset.region)"


def test_the_page_is_open_static_and_locked_down(cluster: Cluster) -> None:
    code, body, headers = http(f"{cluster.daemons['r1'].url}/ui", token=None)
    assert code == 200 and headers["Content-Type"].startswith("text/html")
    csp = headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert "unsafe-inline" not in csp and "form-action 'none'" in csp
    assert b"http://" not in body and b"https://" not in body, "no external resources"
    assert TOKEN.encode() not in body


needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (Debian: "
                                    "apt-get install chromium; .ci/run installs it)")


@needs_chromium
async def test_the_browser_driver_sees_console_errors_exceptions_and_csp_violations(
        tmp_path: Path) -> None:
    """What the page test's "no console errors" rests on: each kind is reported."""
    page = ("<meta http-equiv='Content-Security-Policy' content=\"script-src 'sha256-"
            + base64.b64encode(hashlib.sha256(b"console.error('boom'); undefined_fn();")
                               .digest()).decode()
            + "'\"><script>console.error('boom'); undefined_fn();</script>"
            "<script>console.log('blocked by the policy')</script>")

    async with Browser(tmp_path) as b:
        await b.open("data:text/html;base64," + base64.b64encode(page.encode()).decode())
        def seen() -> bool:
            text = " | ".join(e["text"] for e in b.errors())
            return all(w in text for w in ("boom", "undefined_fn", "Content Security Policy"))

        await async_wait_until(seen, 20, "the console error, the exception and the CSP report")
        errors = " | ".join(e["text"] for e in b.errors())
    assert "boom" in errors and "undefined_fn" in errors, errors
    assert "Content Security Policy" in errors, errors


@needs_chromium
async def test_the_fleet_page_in_chromium_shows_regions_and_a_new_version(
        cluster: Cluster, tmp_path: Path) -> None:
    c, tmp = cluster, tmp_path
    trainer = c.daemons["trainer"]
    async with Browser(tmp) as b:
        await b.open(f"{trainer.url}/ui")
        assert await b.eval(f"{SHOWN_JS}('login') && !{SHOWN_JS}('main')"), "asks for the token"
        assert not [r for r in b.requests if "/v1/" in r["url"]], "no API call before a token"
        await b.eval(f"document.getElementById('token').value = {json.dumps(TOKEN)}; "
                     "document.getElementById('login').requestSubmit(); true")
        regions = await b.wait_for(
            f"(r => ['east', 'west', 'trainer'].every(x => r.includes(x)) && r)({REGIONS_JS})",
            30, "every region on the page")
        assert sorted(regions) == ["east", "trainer", "west"]
        assert await b.eval(f"!{SHOWN_JS}('login') && {SHOWN_JS}('forget')"), "form hidden"
        await b.wait_for(f"(v => v.r1 === '0' && v.r2 === '0')(JSON.parse({VERSIONS_JS}))", 30,
                         "r1 and r2 at v0 on the page")

        c.state = step(c.state, 1)  # type: ignore[attr-defined]
        await asyncio.to_thread(c.publish, 1, c.state)  # type: ignore[attr-defined]
        await asyncio.to_thread(c.wait_all_at, 1, 120)
        await b.wait_for("document.getElementById('head').textContent === '1'", 30,
                         "the new head on the page")
        await b.wait_for(f"(v => ['trainer', 'r1', 'r2'].every(n => v[n] === '1'))"
                         f"(JSON.parse({VERSIONS_JS}))", 30, "every node at v1 on the page")
        local = await b.eval("document.getElementById('local').textContent")
        assert "engine" in local and "bans" in local and "self-check" in local
        shot = await b.screenshot(tmp / "fleet-page.png")
        print(f"screenshot: {shot}")

        assert not b.errors(), f"console errors: {b.errors()}"
        assert await b.eval("sessionStorage.getItem('deltaswarm.token')") == TOKEN
        assert TOKEN not in await b.eval("location.href")
        api = [r for r in b.requests if "/v1/" in r["url"]]
        assert api and all(TOKEN not in r["url"] for r in b.requests)
        assert all(r["headers"].get("Authorization") == f"Bearer {TOKEN}" for r in api)
        assert shot.stat().st_size > 10_000
