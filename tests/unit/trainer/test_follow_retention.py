"""Every publisher follows the trainer daemon's retention decision (issue 20, finding 2): with
the daemon's decision recorded in the chain dir (it keeps v2.. deltas for a node behind at v1),
Publisher, CheckpointPublisher (`deltaswarm publish` / `watch`) and ShardedPublisher, each
configured with a one-version window of their own, delete none of the deltas it keeps."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from chain import keys
from chain.follow import publisher_retain
from chain.policy import Retention, SnapshotPolicy, record_decision
from chain.store import ChainStore
from tests.conftest import perturb
from trainer.checkpoints import CheckpointPublisher, inspect_checkpoint
from trainer.publisher import Publisher
from trainer.sharded import ShardedPublisher

OWN = Retention(versions=1)
"""What each publisher would delete by on its own: everything but the head."""
DAEMON = Retention(versions=2)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(16, 32, generator=g).to(torch.bfloat16)
            for i in range(4)}


@pytest.fixture
def chain(tmp_path: Path):
    """v0..v5 (snapshots at v0 and v3), and the daemon's recorded decision: a node at v1."""
    keys.generate(tmp_path / "k")
    pub = Publisher(tmp_path / "chain", tmp_path / "k", "r",
                    snapshots=SnapshotPolicy(every=3, max_delta_ratio=1e9),
                    retention=Retention(versions=1000))
    states = [_state(0)]
    for v in range(1, 7):
        states.append(perturb(states[-1], v))
    for v in range(6):
        pub.publish(v, states[v])
    record_decision(tmp_path / "chain", DAEMON, [1])
    assert DAEMON.decide(pub.store.manifests(), [1]).kept_for == (1,)
    return tmp_path, states


def _kept_for_the_node_behind(chain_dir: Path, head: int) -> None:
    store = ChainStore(chain_dir)
    assert store.head() == head
    for v in range(2, head + 1):
        m = store.get(v, "delta")
        assert m is not None, f"v{v}.delta, kept by the daemon for the node at v1, was deleted"
        assert store.has_blocks(m), f"v{v}.delta lost blocks"


def test_publisher_not_linked_to_the_daemon_follows_its_recorded_decision(chain):
    tmp, states = chain
    pub = Publisher(tmp / "chain", tmp / "k", "r", retention=OWN,
                    snapshots=SnapshotPolicy(every=1000))
    pub.resume(states[5])
    pub.publish(6, states[6])
    _kept_for_the_node_behind(tmp / "chain", 6)


def test_checkpoint_publisher_follows_the_daemons_decision(chain):
    tmp, states = chain
    d = tmp / "step_6"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    save_file(states[6], str(d / "model.safetensors"))
    pub = CheckpointPublisher(tmp / "chain", tmp / "k", "r", tmp / "pub", retention=OWN,
                              snapshots=SnapshotPolicy(every=1000))
    assert pub.publish(inspect_checkpoint(d), 6).version == 6
    _kept_for_the_node_behind(tmp / "chain", 6)


def test_sharded_publisher_follows_the_daemons_decision(chain):
    tmp, states = chain
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'pg'}", rank=0, world_size=1)
    try:
        pub = ShardedPublisher(tmp / "chain", "r", key_path=tmp / "k", retention=OWN,
                               snapshots=SnapshotPolicy(every=1000))
        assert pub.resume(states[5]) == 5
        assert pub.publish(6, states[6]).version == 6
    finally:
        dist.destroy_process_group()
    _kept_for_the_node_behind(tmp / "chain", 6)


def test_the_rule(chain):
    tmp, _ = chain
    store = ChainStore(tmp / "chain")
    before, want = set(store.artifacts()), set(DAEMON.decide(store.manifests(), [1]).keep)
    # The daemon took this publish: it applied its decision itself.
    assert publisher_retain(store, OWN, daemon=True, notified=True) == []
    # Not told (down, slow): its recorded decision, which keeps v2.. for the node at v1.
    dropped = publisher_retain(store, OWN, daemon=True, notified=False)
    assert set(dropped) == before - want and set(store.artifacts()) == want
    assert all(store.get(v, "delta") for v in range(2, 6))
    (tmp / "chain" / "retention.json").unlink()
    # No decision yet but a daemon linked: it decides on its first publish; nothing here.
    assert publisher_retain(store, OWN, daemon=True, notified=False) == []
    # No daemon at all: the publisher's own window.
    own = set(OWN.decide(store.manifests()).keep)
    assert publisher_retain(store, OWN, daemon=False, notified=False)
    assert set(store.artifacts()) == own and "v00000002.delta" not in own
