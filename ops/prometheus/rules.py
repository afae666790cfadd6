"""Render deltaswarm's Prometheus alert rules (ops/prometheus/deltaswarm-rules.yml) with the
thresholds as options: Prometheus rule files have no variables, so the committed file is this
script's output with its defaults (tuned for a run publishing every few minutes), and a test
checks that the two agree.

    python ops/prometheus/rules.py                       # the defaults, to stdout
    python ops/prometheus/rules.py --behind-for 20m --no-publish-for 2h -o my-rules.yml

Each alert's runbook entry is in docs/OPERATIONS.md (the `runbook` annotation names its anchor).
Per-node series carry only `instance`/`job`; the rules join `deltaswarm_node_info` to add the
node's `node`, `region` and `role` labels. Fleet series (`deltaswarm_fleet_*`) exist only on a
scrape that presents the swarm token.
"""

import argparse
import re
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
COMMITTED = HERE / "deltaswarm-rules.yml"
RUNBOOK = "docs/OPERATIONS.md"
_DURATION = re.compile(r"^([0-9]+)(s|m|h|d)$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_JOB = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")


class BadThreshold(ValueError):
    """A threshold option is malformed; the message names the option."""


def seconds(name: str, value: str) -> int:
    """A Prometheus duration like `10m` as seconds; BadThreshold naming the option if not."""
    m = _DURATION.match(value)
    if m is None or int(m.group(1)) == 0:
        raise BadThreshold(f"--{name.replace('_', '-')}={value!r}: want a positive Prometheus "
                           "duration such as 90s, 10m, 2h or 1d")
    return int(m.group(1)) * _UNIT_S[m.group(2)]


@dataclass(frozen=True)
class Thresholds:
    """Every knob of the rules; the defaults suit a run publishing every 2-5 minutes."""

    job: str = "deltaswarm"
    """The Prometheus scrape job of the daemons (for `up`)."""
    down_for: str = "2m"
    """A daemon not answering scrapes this long."""
    behind_for: str = "10m"
    """A region or node behind the head this long (a version should land in ~1 min)."""
    no_publish_for: str = "30m"
    """The trainer's head has not moved this long (several missed publishes)."""
    stale_for: str = "5m"
    """Fleet nodes marked stale (no report within 3 intervals) this long."""
    spool_depth: int = 1000
    """Trajectories held in a region's spool above which growth is a problem."""
    spool_growing_for: str = "15m"
    """The spool above `spool_depth` and still growing this long."""
    event_window: str = "15m"
    """How long an event (engine failure, refused manifest, 429, rejected batch) keeps its
    alert firing."""
    corruption_window: str = "1h"
    """How long a found-corrupt block keeps the self-check alert firing."""
    unrepaired_for: str = "30m"
    """Corrupt blocks found but not repaired this long."""

    def check(self) -> "Thresholds":
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "job":
                if not _JOB.match(value):
                    raise BadThreshold(f"--job={value!r}: want a Prometheus job name "
                                       "(letters, digits, _ . : -)")
            elif f.name == "spool_depth":
                if not isinstance(value, int) or value < 0:
                    raise BadThreshold(f"--spool-depth={value!r}: want an integer >= 0")
            else:
                seconds(f.name, value)
        return self


def per_node(expr: str) -> str:
    """`expr` (one series per daemon) labelled with the daemon's node, region and role."""
    return f"({expr}) * on (instance, job) group_left (node, region, role) deltaswarm_node_info"


def alert(name: str, expr: str, for_: str, severity: str, summary: str, description: str
          ) -> dict:
    return {"alert": name, "expr": expr, "for": for_,
            "labels": {"severity": severity, "service": "deltaswarm"},
            "annotations": {"summary": summary, "description": description,
                            "runbook": f"{RUNBOOK}#{name.lower()}"}}


def rules(t: Thresholds) -> dict:
    t.check()
    behind_s = seconds("behind_for", t.behind_for)
    no_pub_s = seconds("no_publish_for", t.no_publish_for)
    ev, corr = t.event_window, t.corruption_window
    who = "{{ $labels.node }} (region {{ $labels.region }})"
    return {"groups": [{"name": "deltaswarm", "rules": [
        alert("DeltaswarmDaemonDown", f'up{{job="{t.job}"}} == 0', t.down_for, "critical",
              "deltaswarm daemon {{ $labels.instance }} is down",
              f"Prometheus has not scraped {{{{ $labels.instance }}}} for {t.down_for}."),
        alert("DeltaswarmRegionBehindHead",
              f"max by (region) (deltaswarm_fleet_max_lag_seconds) > {behind_s}", "1m",
              "warning", "Region {{ $labels.region }} is behind the head",
              "The furthest-behind fresh node of region {{ $labels.region }} has lacked the "
              "head for {{ $value | humanizeDuration }} (threshold " + t.behind_for + ")."),
        alert("DeltaswarmNodeBehindHead", per_node("deltaswarm_lag_versions") + " > 0",
              t.behind_for, "warning", f"{who} is behind the head",
              f"{who} has been {{{{ $value }}}} version(s) behind the head it knows for "
              f"{t.behind_for}."),
        alert("DeltaswarmNoNewVersion",
              f"changes(deltaswarm_head_version[{t.no_publish_for}]) == 0"
              ' and on (instance, job) deltaswarm_node_info{role="trainer"}'
              f" and on (instance, job) deltaswarm_uptime_seconds > {no_pub_s}",
              "0m", "warning", "No new policy version for " + t.no_publish_for,
              "The trainer's daemon {{ $labels.instance }} has the same head as "
              f"{t.no_publish_for} ago: the trainer is not publishing."),
        alert("DeltaswarmFleetNodesStale",
              "max by (region) (deltaswarm_fleet_stale_nodes) > 0", t.stale_for, "warning",
              "{{ $value }} node(s) of region {{ $labels.region }} stopped reporting",
              "Fleet reports from {{ $value }} node(s) of region {{ $labels.region }} are older "
              f"than three report intervals, for {t.stale_for}."),
        alert("DeltaswarmEngineNotifyFailing",
              per_node(f"increase(deltaswarm_engine_notification_failures_total[{ev}])") + " > 0",
              "0m", "warning", f"{who}: the engine refused new weights",
              f"{who} failed to hand a version to its engine in the last {ev}."),
        alert("DeltaswarmEngineCheckMismatch",
              per_node(f"increase(deltaswarm_engine_check_mismatches_total[{ev}])") + " > 0",
              "0m", "warning", f"{who}: the engine's live weights differed from the version",
              f"The read-back after an update found different weights on {who} in the last "
              f"{ev}; a full reload followed."),
        alert("DeltaswarmEngineRepairFailed",
              per_node(f"increase(deltaswarm_engine_repair_failures_total[{ev}])") + " > 0"
              " or " + per_node("deltaswarm_engine_check_ok") + " == 0",
              "0m", "critical", f"{who}: the engine serves weights that are not the version",
              f"A full reload on {who} still differed, or the last check failed: rollouts "
              "there use unknown weights."),
        alert("DeltaswarmTrajectorySpoolGrowing",
              per_node("deltaswarm_spool_depth") + f" > {t.spool_depth}"
              f" and on (instance, job) delta(deltaswarm_spool_depth[{t.spool_growing_for}]) > 0",
              t.spool_growing_for, "warning", f"{who}: the trajectory spool keeps growing",
              f"{{{{ $value }}}} trajectories wait in {who}'s spool, above {t.spool_depth} and "
              f"growing for {t.spool_growing_for}: the upstream is not taking them."),
        alert("DeltaswarmTrajectorySpoolFull",
              per_node(f"increase(deltaswarm_spool_rejected_full_total[{ev}])") + " > 0", "0m",
              "warning", f"{who}: the trajectory spool is full",
              f"{who} answered workers' posts with 429 in the last {ev}."),
        alert("DeltaswarmTrajectoriesRejected",
              per_node(f"increase(deltaswarm_spool_rejected_invalid_total[{ev}])") + " > 0",
              "0m", "warning", f"{who}: the upstream refused trajectories as invalid",
              f"Trajectories from {who} were set aside in the last {ev}."),
        alert("DeltaswarmPeersBanned", per_node("deltaswarm_banned_peers") + " > 0", "0m",
              "warning", f"{who} banned {{{{ $value }}}} peer(s) for bad data",
              f"{who} holds bans on peers that sent blocks failing the hash check."),
        alert("DeltaswarmSelfCheckCorruption",
              per_node(f"increase(deltaswarm_self_check_corrupt_blocks_total[{corr}])") + " > 0",
              "0m", "warning", f"{who} found corrupt blocks on its own disk",
              f"The self-check on {who} found served blocks corrupt in the last {corr}."),
        alert("DeltaswarmCorruptionUnrepaired",
              per_node("deltaswarm_self_check_corrupt_blocks_total"
                       " - deltaswarm_self_check_repaired_blocks_total") + " > 0",
              t.unrepaired_for, "critical", f"{who} holds corrupt blocks it could not repair",
              f"{{{{ $value }}}} corrupt block(s) on {who} were not refetched for "
              f"{t.unrepaired_for}."),
        alert("DeltaswarmWeightsProblem", per_node("deltaswarm_weights_problem") + " > 0",
              "0m", "warning", f"{who} found its stored weights damaged at start",
              f"{who}'s start-up check set a damaged version aside and it rebuilds from a "
              "snapshot; /v1/status weights_problem says what failed."),
        alert("DeltaswarmManifestsRefused",
              per_node(f"sum by (instance, job) (increase(deltaswarm_refused_manifests_total"
                       f"[{ev}]))") + " > 0", "0m", "warning",
              f"{who} refused manifests",
              f"{who} refused manifests in the last {ev} (unsigned, bad "
              "signature, replay, another run): a misconfigured or hostile peer."),
        alert("DeltaswarmIdentityClaimsRefused",
              per_node(f"increase(deltaswarm_identity_refused_claims_total[{ev}])") + " > 0",
              "0m", "warning",
              f"{who} refused a claim to a node name",
              f"{who} refused a node name claimed with another key than the one pinned for "
              f"it, in the last {ev}: a node whose state_dir was lost, or someone speaking for "
              "a node it is not."),
        alert("DeltaswarmFleetReportsRefused",
              f"increase(deltaswarm_fleet_refused_entries_total[{ev}]) > 0", "0m", "warning",
              "{{ $labels.instance }} refused fleet report entries",
              "A token holder reported entries {{ $labels.instance }} refused in the last "
              f"{ev} (a node name claimed from another URL, or a full board)."),
    ]}]}


HEADER = """\
# deltaswarm alert rules. GENERATED by ops/prometheus/rules.py ({args}); do not edit by hand:
# change the options and re-render. Runbook: docs/OPERATIONS.md.
"""


def render(t: Thresholds) -> str:
    changed = [f"--{f.name.replace('_', '-')} {getattr(t, f.name)}" for f in fields(t)
               if getattr(t, f.name) != f.default]
    body = yaml.safe_dump(rules(t), sort_keys=False, width=1000, default_flow_style=False)
    return HEADER.format(args=" ".join(changed) or "defaults") + body


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(Thresholds):
        p.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=f.default,
                       type=type(f.default), help=f"default {f.default}")
    p.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    a = vars(p.parse_args(argv))
    out = a.pop("output")
    try:
        text = render(Thresholds(**a))
    except BadThreshold as e:
        print(f"rules.py: {e}", file=sys.stderr)
        return 2
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
