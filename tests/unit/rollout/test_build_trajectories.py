"""The worker builds what the daemon and the trainer accept: a -inf log-prob from the engine is
clamped to the documented floor, anything else invalid is dropped and counted, never posted."""

from chain.trajectory import LOGPROB_FLOOR, parse_ndjson
from rollout.engine import Completion
from rollout.worker import build_trajectories
from tests.trajectories import ndjson


class Task:
    def reward(self, prompt: str, text: str) -> float:
        return float("nan") if text == "nan" else 1.0


def completion(text: str = "7", logprobs: tuple = (-0.5, -0.1)) -> Completion:
    return Completion(prompt="3+4=", prompt_ids=[1, 9, 12], text=text, token_ids=[5, 6],
                      logprobs=list(logprobs), version=3)


def test_what_the_worker_builds_is_a_valid_trajectory() -> None:
    built = build_trajectories([completion() for _ in range(4)], Task(), 2, "eu", "w1")
    assert [tid for tid, _ in parse_ndjson(ndjson(built))] == [t["id"] for t in built]
    assert len({t["group"] for t in built}) == 2


def test_worker_clamps_minus_inf_logprobs_and_drops_what_else_is_invalid() -> None:
    stats: dict[str, int] = {}
    built = build_trajectories(
        [completion(logprobs=(float("-inf"), -0.1)), completion(text="nan"),
         completion(logprobs=(float("nan"), -0.1)), completion()], Task(), 4, "eu", "w1", stats)
    assert stats == {"clamped_logprobs": 1, "dropped_invalid": 2}
    assert [t["logprobs"] for t in built] == [[LOGPROB_FLOOR, -0.1], [-0.5, -0.1]]
    assert len(parse_ndjson(ndjson(built))) == 2
