"""The chaos run's verdicts (tests/integration/chaos_checks.py) never pass on a run that did not
happen: an aborted scenario, or one that collected no status, fails every property."""

import pytest

from tests.integration.chaos_checks import CHECKS
from tests.integration.chaos_record import ChaosRun, Params, Sampler, bound_terms


def _aborted() -> ChaosRun:
    run = ChaosRun(Params(), regions=["eu1", "us1"])
    run.errors.append("RuntimeError: the trainer never became ready")
    return run


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_every_property_fails_an_aborted_run(name):
    problems = CHECKS[name](_aborted())
    assert problems and "the trainer never became ready" in problems[0]


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_every_property_fails_a_run_with_no_final_status(name):
    run = ChaosRun(Params(), regions=["eu1"])
    run.statuses = {"trainer": {}}
    assert any("no final status from ['eu1']" in p for p in CHECKS[name](run))


def test_the_bound_caps_slow_measured_terms():
    """A build that applies and transfers 100x slower does not get a 100x bound."""
    p, s = Params(), Sampler()
    s.snapshot_rate = {"eu1": 1_000.0}  # 1 kB/s measured
    s.apply_seconds = lambda kind, n: 500.0  # stand-in for 500 s measured applies
    terms = bound_terms(p, s, snapshot_bytes=15_000_000, knobs={})
    assert sum(terms.values()) <= 2 * p.interval_s + 2 * 15_000_000 / p.thin_rate + 12 + 15
