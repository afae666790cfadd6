"""The alert rules (ops/prometheus/) checked by the real tool: the committed file is what the
renderer makes with its defaults, `promtool check rules` accepts it (and a re-rendering with other
thresholds), `promtool test rules` runs the synthetic-series unit tests (which alerts fire, which
stay quiet), every alert has a firing case there and a runbook entry in docs/OPERATIONS.md, and
the unit tests fail on rules rendered with other thresholds (they test the thresholds)."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
OPS = ROOT / "ops" / "prometheus"
RULES = OPS / "deltaswarm-rules.yml"
UNIT = OPS / "deltaswarm-rules.test.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian: apt-get install prometheus; "
    ".ci/run installs it)")


def render(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(OPS / "rules.py"), *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)


def promtool(*args: str, cwd: Path = OPS) -> subprocess.CompletedProcess:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


def alert_names(text: str) -> list[str]:
    return [r["alert"] for g in yaml.safe_load(text)["groups"] for r in g["rules"]]


def test_the_committed_rules_are_the_rendered_defaults() -> None:
    out = render()
    assert out.returncode == 0, out.stderr
    assert out.stdout == RULES.read_text(), (
        "ops/prometheus/deltaswarm-rules.yml differs from the renderer's defaults: run "
        "`python ops/prometheus/rules.py -o ops/prometheus/deltaswarm-rules.yml`")


def test_thresholds_are_options_and_bad_ones_are_named() -> None:
    out = render("--behind-for", "20m", "--spool-depth", "50", "--job", "ds")
    assert out.returncode == 0, out.stderr
    assert "> 1200" in out.stdout and "> 50" in out.stdout and 'up{job="ds"}' in out.stdout
    assert "--behind-for 20m" in out.stdout.splitlines()[0]
    bad = render("--no-publish-for", "ten minutes")
    assert bad.returncode == 2 and "--no-publish-for='ten minutes'" in bad.stderr
    bad = render("--job", 'x"} or vector(1) #')
    assert bad.returncode == 2 and "--job=" in bad.stderr


def test_every_alert_has_a_runbook_entry_and_a_firing_unit_test() -> None:
    names = alert_names(RULES.read_text())
    assert len(names) == len(set(names)) >= 15
    doc = (ROOT / "docs" / "OPERATIONS.md").read_text()
    anchors = {m.lower() for m in re.findall(r"^#### (\w+)", doc, re.M)}
    assert set(n.lower() for n in names) <= anchors, set(names) - anchors
    unit = yaml.safe_load(UNIT.read_text())
    fired = {t["alertname"] for test in unit["tests"] for t in test["alert_rule_test"]
             if t.get("exp_alerts")}
    quiet = {t["alertname"] for test in unit["tests"] for t in test["alert_rule_test"]
             if not t.get("exp_alerts")}
    assert set(names) == fired, f"alerts without a firing test: {set(names) - fired}"
    assert len(quiet) >= 12, "each alert should also have a case where it stays quiet"


@needs_promtool
def test_promtool_check_rules_accepts_defaults_and_other_thresholds(tmp_path: Path) -> None:
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_names(RULES.read_text()))} rules found" in out.stdout
    other = tmp_path / "other.yml"
    assert render("--behind-for", "1h", "--stale-for", "90s", "--event-window", "2h",
                  "-o", str(other)).returncode == 0
    out = promtool("check", "rules", str(other))
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_promtool_unit_tests_pass() -> None:
    out = promtool("test", "rules", UNIT.name)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


@needs_promtool
@pytest.mark.parametrize("mutant", [
    ("--behind-for", "20m"), ("--no-publish-for", "10m"), ("--spool-depth", "5000"),
    ("--down-for", "10m"),
])
def test_promtool_unit_tests_fail_on_other_thresholds(tmp_path: Path, mutant: tuple) -> None:
    """The unit tests pin the default thresholds: rules rendered with another one fail them."""
    assert render(*mutant, "-o", str(tmp_path / RULES.name)).returncode == 0
    shutil.copy(UNIT, tmp_path / UNIT.name)
    out = promtool("test", "rules", UNIT.name, cwd=tmp_path)
    assert out.returncode != 0 and "FAILED" in out.stdout + out.stderr, out.stdout
