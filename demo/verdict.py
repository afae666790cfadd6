"""The demo's pass/fail: the swarm checks of demo/view.py's `verdict`, and learning judged by the
greedy score on held-out problems.

The success check is the greedy reward (one completion per prompt, temperature 0) on problems
of the task's held-out split, which neither the warm-up nor the workers ever sample: it must
rise from v0 to the last version by `min_reward_gain`. The score at the sampling temperature,
which view.verdict checks, is shown but not judged: in the earlier demo it rose in every run
while the greedy score on the same prompts fell (RL had sharpened the sampled answer format, not
the answers), so it can pass a run whose policy did not get better at the task. A second check
reads every trajectory the trainer received and counts those whose prompt is held out: it must
be none, or the split was not held out.
"""

import json
import sqlite3
from pathlib import Path

from demo.config import DemoConfig, with_overrides
from demo.heldout import Score


def _at(scores: list[Score], version: int) -> Score | None:
    return next((x for x in scores if x.version == version), None)


def greedy_gain(cfg: DemoConfig, scores: list[Score], problems: int) -> tuple[bool, str]:
    """(passed, line): the greedy held-out reward of the last version against v0's."""
    gain = cfg.min_reward_gain
    first, last = _at(scores, 0), _at(scores, cfg.steps)
    if first is None or last is None:
        missing = " and ".join(f"v{v}" for v, x in ((0, first), (cfg.steps, last)) if x is None)
        return False, f"held-out set not scored on {missing}"
    rise = last.greedy - first.greedy
    return rise >= gain - 1e-9, (
        f"greedy reward on {problems} held-out problems {first.greedy:.3f} → {last.greedy:.3f} "
        f"({rise:+.3f}; solved {100 * first.solved:.0f} % → {100 * last.solved:.0f} %) from v0 "
        f"to v{cfg.steps} (needs {gain:+.3f})")


def trained_on_heldout(db: Path, heldout: set[str]) -> tuple[int, int] | None:
    """(trajectories whose prompt is a held-out problem, trajectories) in the trainer's ingest
    store (trainer/ingest.py), only read; None if it cannot be read."""
    if not db.is_file():
        return None
    try:
        con = sqlite3.connect(db, timeout=10)
    except sqlite3.Error:
        return None
    try:
        rows = con.execute("SELECT record FROM trajectories").fetchall()
    except sqlite3.Error:
        return None
    finally:
        con.close()
    bad = 0
    for (record,) in rows:
        try:
            bad += json.loads(record).get("prompt") in heldout
        except (ValueError, AttributeError):
            continue
    return bad, len(rows)


def verdict(cfg: DemoConfig, metrics: list[dict], statuses: dict[str, dict | None], out: Path,
            scores: list[Score], heldout: set[str], scored: int
            ) -> tuple[bool, list[tuple[bool, str]]]:
    """Every check as (passed, line), and whether all passed. `heldout` is the task's whole
    held-out split, `scored` how many of its problems the evaluator scores."""
    from demo.view import verdict as swarm_verdict

    _, reasons = swarm_verdict(with_overrides(cfg, min_reward_gain=-1), metrics, statuses,
                               out, scores)
    leak = trained_on_heldout(out / "trainer" / "ingest" / "ingest.db", heldout)
    if leak is None:
        reasons.append((False, "cannot read the trainer's trajectories to check the split"))
    else:
        reasons.append((leak[0] == 0 and leak[1] > 0,
                        f"{leak[0]} of {leak[1]} trajectories the trainer received were "
                        "held-out problems"))
    if cfg.min_reward_gain > -1:
        reasons.append(greedy_gain(cfg, scores, scored))
    return all(r[0] for r in reasons), reasons


def summary_rows(cfg: DemoConfig, scores: list[Score], scored: int, split: int
                 ) -> list[tuple[str, str]]:
    """Rows for the summary table: the success measure and the margin it must clear."""
    first, last = _at(scores, 0), _at(scores, cfg.steps)
    if first is None or last is None:
        return []
    need = ("not checked" if cfg.min_reward_gain <= -1
            else f"needs {cfg.min_reward_gain:+.3f}")
    return [(f"success: greedy reward, {scored} of the {split} held-out problems (never "
             f"trained on), v0 → v{cfg.steps}",
             f"{first.greedy:.3f} → {last.greedy:.3f} ({last.greedy - first.greedy:+.3f}, "
             f"{need}); solved {100 * first.solved:.1f} % → {100 * last.solved:.1f} %")]
