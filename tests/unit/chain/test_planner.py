"""The planner over what exists: with holder counts it prefers a path whose every artifact some
live peer holds (issue 11, finding 1: a delta only a dead trainer held kept regions waiting),
and among those the fewest bytes."""

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chain.errors import NoPath
from chain.manifest import artifact_name
from chain.planner import paths, plan


@dataclass(frozen=True)
class Art:
    version: int
    kind: str
    payload_bytes: int

    @property
    def name(self) -> str:
        return artifact_name(self.version, self.kind)


def chain(head: int, snapshots: set[int], delta_bytes: int = 250, snap_bytes: int = 14_000,
          missing: set[int] = frozenset()) -> dict[str, Art]:
    arts = [Art(v, "delta", delta_bytes) for v in range(1, head + 1) if v not in missing]
    arts += [Art(v, "snapshot", snap_bytes) for v in snapshots]
    return {a.name: a for a in arts}


def names(p: list) -> list[str]:
    return [artifact_name(m.version, m.kind) for m in p]


def test_plan_goes_around_a_delta_nobody_holds_to_a_later_snapshot():
    ms = chain(24, {0, 16})
    holders = {name: 1 for name in ms} | {"v00000008.delta": 0}
    assert names(plan(ms, 7, 24))[0] == "v00000008.delta"  # cheapest, but nobody has v8
    got = names(plan(ms, 7, 24, holders))
    assert got[0] == "v00000016.snapshot"
    assert got[1:] == [artifact_name(v, "delta") for v in range(17, 25)]


def test_plan_treats_an_artifact_missing_from_holders_as_unheld():
    ms = chain(5, {0, 3})
    holders = {n: 2 for n in ms if n != "v00000004.delta"}
    with pytest.raises(NoPath):
        plan({n: m for n, m in ms.items() if "snapshot" not in n}, None, 5, holders)
    # every path needs v4 here: the cheapest of them is still returned (it may reappear)
    assert names(plan(ms, 2, 5, holders)) == ["v00000003.delta", "v00000004.delta",
                                              "v00000005.delta"]


@st.composite
def chains(draw):
    head = draw(st.integers(1, 30))
    snaps = draw(st.sets(st.integers(0, head), min_size=1, max_size=5))
    missing = draw(st.sets(st.integers(1, head), max_size=4))
    arts = [Art(v, "delta", draw(st.integers(1, 1000))) for v in range(1, head + 1)
            if v not in missing]
    arts += [Art(v, "snapshot", draw(st.integers(1, 20_000))) for v in snaps]
    ms = {a.name: a for a in arts}
    have = draw(st.one_of(st.none(), st.integers(0, head)))
    holders = {n: draw(st.integers(0, 3)) for n in ms}
    return ms, have, head, holders


@settings(max_examples=300, deadline=None)
@given(chains())
def test_plan_is_a_valid_path_and_the_cheapest_fully_held_one_when_any_exists(case):
    ms, have, head, holders = case
    options = paths(ms, have, head)
    if have == head:
        assert plan(ms, have, head, holders) == []
        return
    if not options:
        with pytest.raises(NoPath):
            plan(ms, have, head, holders)
        return
    got = plan(ms, have, head, holders)
    assert got in options
    assert got[-1].version == head
    first = got[0]
    assert (first.kind == "snapshot" and (have is None or first.version > have)) or \
        (first.kind == "delta" and first.version == have + 1)
    held = [p for p in options if all(holders[names([m])[0]] > 0 for m in p)]
    if held:
        assert got in held
        assert sum(m.payload_bytes for m in got) == min(sum(m.payload_bytes for m in p)
                                                        for p in held)
