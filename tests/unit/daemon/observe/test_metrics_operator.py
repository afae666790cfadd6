"""The two series the alert rules and dashboard needed (issue 25): `deltaswarm_weights_problem`
(1 once the start-up check found damaged weights) and `deltaswarm_apply_seconds` (the last
version's apply; absent before the first)."""

from prometheus_client.parser import text_string_to_metric_families

from daemon.observe.metrics import build_registry, render
from daemon.observe.status import NodeStatus


def samples(status: NodeStatus) -> dict[str, float]:
    text = render(build_registry(lambda: status))[0].decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_weights_problem_is_0_until_the_start_up_check_finds_damage() -> None:
    assert samples(NodeStatus(node="n"))["deltaswarm_weights_problem"] == 0.0
    hurt = NodeStatus(node="n", weights_problem="v00000003 tensor layers.0 digest mismatch")
    assert samples(hurt)["deltaswarm_weights_problem"] == 1.0


def test_apply_seconds_appears_after_the_first_apply() -> None:
    assert "deltaswarm_apply_seconds" not in samples(NodeStatus(node="n"))
    assert samples(NodeStatus(node="n", last_apply_s=2.5))["deltaswarm_apply_seconds"] == 2.5
