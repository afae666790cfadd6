"""The systemd units: `systemd-analyze verify` accepts them with no warning, and they carry the
settings the daemon relies on (notify + watchdog, restart, directories, hardening, stop timeout
above the daemon's drain bound).

verify requires every Exec program to exist, so the units are copied to a temp dir first with
/opt/deltaswarm/.venv/bin/deltaswarm replaced by this venv's `deltaswarm` (and any other missing
program by `true`). Needs Debian's systemd package (`apt-get install -y systemd procps`).
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.config import Config

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "systemd"
INSTALLED = "/opt/deltaswarm/.venv/bin/deltaswarm"
DAEMON, TRAINER, ROLLOUT = (
    "deltaswarm-daemon@.service", "deltaswarm-trainer.service", "deltaswarm-rollout@.service",
)
INGEST, WATCH = "deltaswarm-ingest.service", "deltaswarm-watch.service"


def settings(name: str) -> dict[tuple[str, str], list[str]]:
    """(section, key) -> values, in order (systemd allows repeated keys)."""
    out: dict[tuple[str, str], list[str]] = {}
    section = ""
    for line in (UNITS / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault((section, key.strip()), []).append(value.strip())
    return out


def one(unit: dict, key: str, section: str = "Service") -> str:
    values = unit.get((section, key))
    assert values, f"{key}= missing from [{section}]"
    return values[-1]


def seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+)(s|min)?", value)
    assert m, f"unexpected time span {value!r}"
    return int(m.group(1)) * (60 if m.group(2) == "min" else 1)


def portable_copy(tmp: Path) -> None:
    local = Path(sys.executable).parent / "deltaswarm"
    true = shutil.which("true") or "/bin/true"
    for unit in UNITS.glob("*.service"):
        lines = []
        for line in unit.read_text().splitlines():
            if line.startswith("Exec"):
                key, _, cmd = line.partition("=")
                if cmd.startswith(INSTALLED) and local.exists():
                    cmd = str(local) + cmd[len(INSTALLED):]
                prog = cmd.split()[0]
                if not Path(prog).exists():
                    cmd = true + cmd[len(prog):]
                line = f"{key}={cmd}"
            lines.append(line)
        (tmp / unit.name).write_text("\n".join(lines) + "\n")


def test_units_pass_systemd_analyze_verify_without_warnings(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (apt-get install -y systemd procps)")
    portable_copy(tmp_path)
    names = ["deltaswarm-daemon@eu-west.service", TRAINER, "deltaswarm-rollout@eu-west.service",
             INGEST, WATCH]
    proc = subprocess.run(
        [analyze, "verify", "--man=no", *names], cwd=tmp_path,
        capture_output=True, text=True, timeout=60,
    )
    # verify returns 0 for unknown keys and unparsable values (it only warns): fail on those too.
    ours = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "deltaswarm" in ln]
    assert proc.returncode == 0 and not ours, proc.stdout + proc.stderr


def test_verify_catches_a_broken_unit(tmp_path):
    """The check above can fail: a typo'd key is reported."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (apt-get install -y systemd procps)")
    portable_copy(tmp_path)
    unit = tmp_path / TRAINER
    unit.write_text(unit.read_text().replace("Restart=on-failure", "Restrat=on-failure"))
    proc = subprocess.run([analyze, "verify", "--man=no", TRAINER], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert "Restrat" in proc.stderr


def test_daemon_unit_is_notify_with_watchdog_and_reload():
    u = settings(DAEMON)
    assert one(u, "Type") == "notify"
    assert one(u, "NotifyAccess") == "main"
    assert seconds(one(u, "WatchdogSec")) >= 10
    assert one(u, "ExecReload") == "/bin/kill -HUP $MAINPID"
    assert one(u, "KillSignal") == "SIGTERM"
    assert one(u, "ExecStart") == f"{INSTALLED} daemon --config /etc/deltaswarm/%i.yaml"


def test_daemon_stop_timeout_exceeds_its_drain_bound():
    drain = Config.model_fields["shutdown_timeout_s"].default
    assert seconds(one(settings(DAEMON), "TimeoutStopSec")) >= drain + 15


@pytest.mark.parametrize("name", [DAEMON, TRAINER, ROLLOUT, INGEST, WATCH])
def test_units_restart_on_failure_as_a_static_user(name):
    u = settings(name)
    assert one(u, "Restart") == "on-failure"
    assert seconds(one(u, "RestartSec")) > 0
    assert one(u, "User") == "deltaswarm"
    assert "DynamicUser" not in {k for _, k in u}
    assert one(u, "StateDirectory").startswith("deltaswarm/")
    assert one(u, "LogsDirectory") == "deltaswarm"


@pytest.mark.parametrize("name", [DAEMON, TRAINER, ROLLOUT, INGEST, WATCH])
def test_units_are_hardened_but_allow_jit_memory(name):
    u = settings(name)
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "ProtectKernelTunables",
                "ProtectKernelModules", "ProtectControlGroups", "RestrictNamespaces",
                "LockPersonality"):
        assert one(u, key) == "yes", key
    assert one(u, "ProtectSystem") == "strict"
    assert one(u, "SystemCallArchitectures") == "native"
    assert one(u, "CapabilityBoundingSet") == ""
    assert set(one(u, "RestrictAddressFamilies").split()) == {
        "AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    assert ("Service", "MemoryDenyWriteExecute") not in u  # numba/torch JIT need W+X pages


def test_daemon_hides_devices_but_gpu_units_do_not():
    assert one(settings(DAEMON), "PrivateDevices") == "yes"
    for name in (TRAINER, ROLLOUT):
        assert ("Service", "PrivateDevices") not in settings(name)


def test_rollout_worker_follows_its_regions_daemon():
    u = settings(ROLLOUT)
    assert "deltaswarm-daemon@%i.service" in one(u, "After", "Unit").split()
    assert "deltaswarm-daemon@%i.service" in one(u, "Wants", "Unit").split()


def test_ingest_and_watch_units_read_their_config_and_take_no_secret_on_the_command_line():
    ingest, watch = settings(INGEST), settings(WATCH)
    assert one(ingest, "ExecStart") == f"{INSTALLED} ingest --config /etc/deltaswarm/ingest.yaml"
    assert one(watch, "ExecStart") == f"{INSTALLED} watch --config /etc/deltaswarm/publish.yaml"
    for u in (ingest, watch):
        assert "--token" not in one(u, "ExecStart")
        assert one(u, "PrivateDevices") == "yes"
    assert "deltaswarm-daemon@trainer.service" in one(watch, "After", "Unit").split()
    # the watcher writes the chain into the trainer daemon's state directory
    assert "deltaswarm/trainer" in one(watch, "StateDirectory").split()
