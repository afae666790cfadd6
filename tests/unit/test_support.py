"""The shared test helpers do what tests rely on: config builders give configs each process's
own loader reads back unchanged, changes are validated, and wait-until returns the first truthy
value or fails naming what it waited for and the last transient error."""

import pytest

from chain.config_base import ConfigError
from daemon.config import load_config
from rollout.config import parse_args
from tests.support import (
    async_wait_until,
    daemon_config,
    trainer_config,
    wait_until,
    worker_config,
    write_config,
)
from trainer.config import load_trainer_config


def test_builders_write_configs_each_process_loads_back(tmp_path):
    d = daemon_config(tmp_path, role="trainer", name="t0", http={"port": 8123})
    assert d.http.port == 8123 and d.http.host == "127.0.0.1" and d.seed_mode
    assert load_config(write_config(d, tmp_path / "d.yaml")) == d
    w = worker_config("http://127.0.0.1:8123", group_size=4)
    assert parse_args(["--config", str(write_config(w, tmp_path / "w.yaml"))])[0] == w
    t = trainer_config(tmp_path, 8800, grpo={"lr": 0.01})
    assert load_trainer_config(write_config(t, tmp_path / "t.yaml")) == t


def test_builder_changes_are_validated_and_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"field http\.port"):
        daemon_config(tmp_path, http={"port": 70000})
    with pytest.raises(ConfigError, match="surprise"):
        worker_config("http://x:1", surprise=1)


def test_wait_until_returns_the_first_truthy_value():
    calls = iter([0, None, OSError("refused"), "up"])

    def pred():
        v = next(calls)
        if isinstance(v, Exception):
            raise v
        return v

    assert wait_until(pred, 5, "the server", interval=0.01) == "up"


def test_wait_until_names_what_and_the_last_error_on_timeout():
    def refused():
        raise ConnectionRefusedError("connection refused")

    with pytest.raises(AssertionError, match=r"waiting for the head.*connection refused"):
        wait_until(refused, 0.1, "the head", interval=0.02)


async def test_async_wait_until_awaits_async_predicates():
    seen = []

    async def pred():
        seen.append(1)
        return len(seen) >= 3 and "done"

    assert await async_wait_until(pred, 5, "three polls", interval=0.01) == "done"
    with pytest.raises(AssertionError, match="never"):
        await async_wait_until(lambda: False, 0.05, "never", interval=0.01)


def test_batch_makes_groups_of_group_size_and_batches_never_share_a_group():
    from collections import Counter

    from tests.trajectories import batch

    first, second = batch(10, group_size=4), batch(4, group_size=4)
    sizes = Counter(t["group"] for t in first)
    assert sorted(sizes.values()) == [2, 4, 4], sizes
    assert not set(sizes) & {t["group"] for t in second}
