"""The Syncer's stop flag (what the daemon's SIGTERM handler sets) abandons an apply between
tensors without making a partial version current; the next apply resumes from the journal and
verifies. In process, through the region's real Syncer, with the flag set before the apply
starts: no signal is sent here (a real daemon's SIGTERM is covered by the chaos run's kills and
the harness, which fails a test whose daemon does not exit 0 on SIGTERM)."""

from pathlib import Path

import pytest

from chain import keys
from chain.sources import StateDictSource
from chain.writer import write_artifact
from daemon.versions.sync import Abandoned
from tests.integration.harness import tiny_model
from tests.integration.test_daemon_manifests import region_node


async def test_a_stop_flag_set_before_apply_abandons_after_one_tensor_and_the_next_resumes(
        tmp_path: Path) -> None:
    key = keys.generate(tmp_path / "trainer.key")
    node = region_node(tmp_path, keys.public_hex(key))
    m, _ = write_artifact(node.store.blocks, key, run="r", version=0, kind="snapshot",
                          new=StateDictSource(tiny_model(0, tensors=4, rows=64, cols=64)))
    node.store.add(m)

    node.syncer.stopping = True
    with pytest.raises(Abandoned):
        await node.syncer.apply(m)
    assert node.weights.current() is None
    staging = node.weights.staging()
    assert len(staging) == 1 and (staging[0] / "JOURNAL").read_text().count("\n") == 1

    node.syncer.stopping = False
    await node.syncer.apply(m)
    cur = node.weights.verify()
    assert cur.version == 0 and cur.state_digest == m.state_digest
    assert node.weights.staging() == []
    assert [a["artifact"] for a in node.syncer.applied] == [m.artifact]
