"""The properties issue 11 asks of a chaos run (tests/integration/chaos_scenario.py), each as a
function returning what is wrong (empty: it holds), so the test and the bench (bench/chaos.py)
judge a run the same way, plus `describe`, the run told in a few lines for a failure message.
"""

import json

from tests.integration.chaos_faults import ban_key
from tests.integration.chaos_record import ChaosRun


def _unjudgeable(run: ChaosRun) -> list[str]:
    """Why this run's data cannot support a verdict: the scenario aborted (its exceptions are
    in run.errors), or a node gave no final status. Every property starts here, so "no
    innocent peer banned" never passes on the empty data of a run that did not happen."""
    out = [f"scenario error: {e}" for e in run.errors]
    missing = [n for n in ["trainer", *run.regions] if n not in run.statuses]
    if missing:
        out.append(f"no final status from {missing}: nothing to judge")
    return out


def premise_problems(run: ChaosRun) -> list[str]:
    """The faults happened as planned; otherwise the other properties prove little: us2 killed
    mid-download and restarted; the trainer killed while a region was fetching the delta only
    it held, and restarted only after its retention window moved past that delta (whether the
    delta was then deleted depends on what the daemon's last decision kept for nodes behind;
    the run records which, `dropped_while_down`); a block corrupted; the late joiner started
    after the early versions were gone."""
    out = _unjudgeable(run)
    vk = run.victim_kill or {}
    if not vk.get("killed"):
        out.append(f"us2 was never killed mid-download ({vk.get('error')})")
    elif not vk.get("restarted"):
        out.append(f"us2 was not restarted ({vk.get('error')})")
    tk = run.trainer_kill
    if "version" not in tk or "restarted_at" not in tk:
        out.append(f"the trainer daemon was not killed and restarted: {tk}")
    if not tk.get("regions_fetching"):
        out.append(f"no region was mid-fetch of v{tk.get('version')}'s delta when the trainer "
                   f"was killed: {tk}")
    if tk.get("head_at_restart", -1) < run.params.trainer_restart_after \
            or "dropped_while_down" not in tk:
        out.append(f"the trainer was restarted before its retention window moved past "
                   f"v{tk.get('version')}'s delta (restart at v{tk.get('head_at_restart')}, "
                   f"window past it from v{run.params.trainer_restart_after}): {tk}")
    if not run.corrupted:
        out.append("no block was corrupted on eu1")
    if not run.late.get("early_gone"):
        out.append(f"the late joiner did not start after early versions were dropped: {run.late}")
    return out


def convergence_problems(run: ChaosRun) -> list[str]:
    if bad := _unjudgeable(run):
        return bad
    want = f"v{run.final} {run.published_digest}"
    out = []
    if run.trainer_digest != run.published_digest:
        out.append(f"the trainer daemon reports digest {run.trainer_digest}, the publisher "
                   f"wrote {run.published_digest}")
    if run.converge_s is None:
        out.append(f"not every live region reached v{run.final} with the trainer's digest "
                   f"within the bound {run.bound_s}s")
    for n in run.regions:
        st = run.statuses.get(n)
        if st is None:
            out.append(f"{n}: no status (not running?)")
            continue
        if (st["current_version"], st["state_digest"]) != (run.final, run.published_digest):
            sync = st.get("detail", {}).get("sync") or {}
            out.append(f"{n}: at v{st['current_version']} (head v{st['head_version']}), last "
                       f"error {sync.get('last_error')!r}")
        elif run.weights.get(n) != want:
            out.append(f"{n}: weights on disk are {run.weights.get(n)}, status says {want}")
    return out


def ban_problems(run: ChaosRun) -> list[str]:
    """Only the corrupted seeder may be banned, and (where bans name a torrent) only for the
    artifact it served corrupt."""
    if bad := _unjudgeable(run):
        return bad
    out = []
    art = (run.corrupted or {}).get("artifact")
    for node, bans in sorted(run.bans_seen.items()):
        for b in bans:
            host, artifact = ban_key(b)
            if host != run.guilty_host:
                out.append(f"{node} banned innocent {host} ({b.get('node')}): {b.get('reason')}")
            elif artifact is not None and artifact != art:
                out.append(f"{node} banned eu1 for {artifact}, which it served intact "
                           f"(only {art} was corrupted): {b.get('reason')}")
    return out


def peer_book_problems(run: ChaosRun) -> list[str]:
    """A peer-book ban (daemon/peering/peers.py: BAN_FAILURES failures in a row, 600 s) also takes a
    peer out of a node's swarm: only the corrupted seeder may earn one. A daemon that was
    killed and restarted, or a region that does not hold what it was asked for, is innocent."""
    if bad := _unjudgeable(run):
        return bad
    out = []
    for node, urls in sorted(run.shunned.items()):
        for url, why in sorted(urls.items()):
            name = run.urls.get(url, url)
            if name != "eu1":
                out.append(f"{node}'s peer book banned innocent {name} ({url}): {why}")
    return out


def self_check_problems(run: ChaosRun) -> list[str]:
    if bad := _unjudgeable(run):
        return bad
    st = run.statuses.get("eu1")
    if st is None:
        return ["eu1 gave no status"]
    sc = st.get("self_check")
    failures = st.get("verification", {}).get("failures_by_kind")
    if sc is None:
        return [f"eu1's status has no self_check: it never re-verifies what it seeds "
                f"(its verification failures: {failures}, block still corrupt on disk: "
                f"{run.block_ok_at_end is False})"]
    out = []
    if sc.get("corrupt_found", 0) < 1 or sc.get("repaired", 0) < 1:
        out.append(f"eu1 self_check found {sc.get('corrupt_found')} corrupt and repaired "
                   f"{sc.get('repaired')}: {json.dumps(sc)[:400]}")
    block = (run.corrupted or {}).get("block")
    if block and not any(e.get("block") == block and e.get("repaired")
                         for e in sc.get("corrupt", [])):
        out.append(f"eu1 self_check does not list block {block} as repaired: "
                   f"{sc.get('corrupt')}")
    if run.block_ok_at_end is False:
        out.append(f"eu1 still holds the corrupted block at {run.corrupted['path']}")
    return out


def late_joiner_problems(run: ChaosRun) -> list[str]:
    if bad := _unjudgeable(run):
        return bad
    snaps = run.late.get("snapshots")
    if snaps is None:
        return ["the late joiner never ran"]
    if len(snaps) > 1:
        return [f"the late joiner downloaded {len(snaps)} snapshots: {snaps}"]
    return []


CHECKS = {"premise": premise_problems, "converged": convergence_problems,
          "bans": ban_problems, "peer_book": peer_book_problems,
          "self_check": self_check_problems,
          "late_joiner": late_joiner_problems}


def describe(run: ChaosRun) -> str:
    lines = [*run.events, f"bound {run.bound_s}s = {run.bound_terms}",
             f"converged in {run.converge_s}s; trainer restart -> all current "
             f"{run.restart_to_current_s}s; knobs {run.knobs}",
             f"trainer kill: { {k: v for k, v in run.trainer_kill.items() if k != 'at'} }",
             f"us2 kill: {run.victim_kill}; corrupted: {run.corrupted}; late: {run.late}"]
    for n in ["trainer", *run.regions]:
        st = run.statuses.get(n, {})
        sync = st.get("detail", {}).get("sync") or {}
        lines.append(f"-- {n}: v{st.get('current_version')} head v{st.get('head_version')} "
                     f"verification {st.get('verification', {}).get('failures_by_kind')} "
                     f"bans {[ban_key(b) for b in run.bans_seen.get(n, [])]} peer-book bans "
                     f"{[run.urls.get(u, u) for u in run.shunned.get(n, {})]} "
                     f"self_check {st.get('self_check')} last_error "
                     f"{sync.get('last_error')!r}")
        logged = run.log_lines.get(n, [])
        cut = next((i for i, x in enumerate(logged) if x.startswith("(exited")), len(logged))
        lines += [f"     {line}" for line in logged[:cut][-12:] + logged[cut:]]
    return "\n".join(lines)
