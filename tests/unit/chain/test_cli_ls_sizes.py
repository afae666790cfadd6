"""`deltaswarm chain ls` states each version's tensor payload and carried files apart, computes
"smaller" on tensors, and, piped into a narrow consumer, prints every value whole (issue 22:
captured, it showed `v00000…` and `46,151…`, and counted an unchanged tokenizer in every
delta). The expected numbers are worked out here from the files written and the tensors, not
with chain/sizes.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

from chain.sources import StateDictSource
from chain.store import ChainStore
from chain.writer import write_artifact
from tests.conftest import make_state, perturb

REPO = Path(__file__).resolve().parents[3]
CONFIG = b'{"hidden_size": 32, "num_layers": 1}' * 40
TOKENIZER = bytes(range(256)) * 300
TOKENIZER_V2 = bytes(reversed(range(256))) * 310


def carried(version: int) -> dict[str, bytes]:
    """The files each version carries: the tokenizer changes at v2, the config never."""
    return {"config.json": CONFIG, "tokenizer.json": TOKENIZER_V2 if version >= 2 else TOKENIZER}


def build(store: ChainStore, key, head: int) -> dict[str, int]:
    """v0 snapshot and deltas to `head`, carrying files; returns each artifact's dense bytes."""
    states = [make_state()]
    dense = sum(t.numel() * t.element_size() for t in states[0].values())
    m, _ = write_artifact(store.blocks, key, run="r1", version=0, kind="snapshot",
                          new=StateDictSource(states[0]), files=carried(0))
    store.add(m)
    for v in range(1, head + 1):
        states.append(perturb(states[-1], v))
        m, _ = write_artifact(store.blocks, key, run="r1", version=v, kind="delta",
                              new=StateDictSource(states[-1]), parent=StateDictSource(states[-2]),
                              parent_manifest=m, files=carried(v))
        store.add(m)
    return {a: dense for a in store.artifacts()}


def ls(chain: Path, *extra: str) -> subprocess.CompletedProcess:
    """`deltaswarm chain ls` with stdout a pipe and a 40-column $COLUMNS: the captured case."""
    return subprocess.run([sys.executable, "-m", "daemon.cli", "chain", "ls", str(chain), *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "40"})


def expected(store: ChainStore, dense: dict[str, int]) -> dict[str, dict]:
    out = {}
    for name in store.artifacts():
        m = store.manifest(name)
        v = m.version
        files = sum(len(d) for d in carried(v).values())
        new = files if v == 0 else sum(len(d) for f, d in carried(v).items()
                                       if carried(v - 1)[f] != d)
        tensors = sum(b.size for b in m.blocks) - files
        out[name] = {"tensor_bytes": tensors, "file_bytes": files, "new_file_bytes": new,
                     "dense_bytes": dense[name], "key": m.signature.key}
    return out


def test_piped_ls_states_tensors_and_carried_files_apart_and_whole(tmp_path, signing_key):
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    want = expected(store, build(store, signing_key, 3))
    r = ls(tmp_path / "chain")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "…" not in r.stdout and "..." not in r.stdout, r.stdout
    lines = r.stdout.splitlines()
    header = lines[0].split()
    assert header[:7] == ["artifact", "kind", "parent", "tensor-bytes", "file-bytes",
                          "new-file-bytes", "smaller"], lines[0]
    rows = {cells[0]: cells for cells in (line.split() for line in lines[1:5])}
    assert set(rows) == set(want)
    for name, w in want.items():
        cells = rows[name]
        assert cells[3] == f"{w['tensor_bytes']:,}", (name, cells)
        assert cells[4] == f"{w['file_bytes']:,}", (name, cells)
        assert cells[5] == f"{w['new_file_bytes']:,}", (name, cells)
        assert cells[6] == f"{w['dense_bytes'] / w['tensor_bytes']:.1f}x", (name, cells)
        assert cells[-1] == w["key"]  # the signer's key whole, not cut to the width
    # the unchanged config and tokenizer are not counted as new in v1 and v3; v2's tokenizer is
    assert rows["v00000001.delta"][5] == "0" and rows["v00000003.delta"][5] == "0"
    assert rows["v00000002.delta"][5] == f"{len(TOKENIZER_V2):,}"
    # the deltas' tensors are a small share of what they list: the ratio must not include files
    d1 = want["v00000001.delta"]
    assert d1["file_bytes"] > d1["tensor_bytes"]
    assert f"{d1['dense_bytes'] / (d1['tensor_bytes'] + d1['file_bytes']):.1f}x" \
        not in rows["v00000001.delta"]
    assert "head: v3" in r.stdout


def test_ls_json_gives_every_number(tmp_path, signing_key):
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    want = expected(store, build(store, signing_key, 2))
    r = ls(tmp_path / "chain", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["head"] == 2
    got = {a["artifact"]: a for a in doc["artifacts"]}
    assert set(got) == set(want)
    for name, w in want.items():
        a = got[name]
        assert (a["tensor_bytes"], a["file_bytes"], a["new_file_bytes"], a["dense_bytes"]) == (
            w["tensor_bytes"], w["file_bytes"], w["new_file_bytes"], w["dense_bytes"]), name
        assert a["smaller_on_tensors"] == round(w["dense_bytes"] / w["tensor_bytes"], 2)
        assert a["files"] == ["config.json", "tokenizer.json"] and a["signed_by"] == w["key"]
