"""What a region says of the versions it fetches and applies (issue 22): the "downloading" log
line and the status totals state the tensor payload and the carried files apart, say how much
is already held (unchanged carried files are the same blocks as the version before), and count
"saved" on tensors. Totals run since start: they used to be summed over the last 50 applied."""

from collections import Counter, deque

from chain.store import ChainStore
from daemon.versions.sync import Syncer, download_line
from tests.unit.chain.test_cli_ls_sizes import TOKENIZER_V2, build, carried


def syncer() -> Syncer:
    s = Syncer.__new__(Syncer)  # only what _applied touches
    s.applied, s.bytes_saved, s.totals, s._last_applied = deque(maxlen=50), 0, Counter(), None
    return s


def test_the_downloading_line_states_tensors_files_and_what_is_held(tmp_path, signing_key):
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    build(store, signing_key, 1)
    m = store.manifest("v00000001.delta")
    files = {f.block for f in m.files}
    file_bytes = sum(len(d) for d in carried(1).values())
    tensor_bytes = m.payload_bytes - file_bytes
    assert download_line(m, files, resumed=False) == (
        f"v00000001.delta: {tensor_bytes:,} B tensors + {file_bytes:,} B carried files, "
        f"{file_bytes:,} B of it already held here; resume data: no")
    assert download_line(m, set(), resumed=True).endswith(
        "carried files, 0 B of it already held here; resume data: yes")


def test_totals_count_tensors_and_carried_files_apart_since_start(tmp_path, signing_key):
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    dense = build(store, signing_key, 3)
    ms = [store.manifest(a) for a in store.artifacts()]  # v0 snapshot, v1..v3 deltas
    s = syncer()
    for m in ms:
        s._applied(m, 0.1)
    files = [sum(len(d) for d in carried(m.version).values()) for m in ms]
    tensors = [m.payload_bytes - f for m, f in zip(ms, files, strict=True)]
    full = dense["v00000001.delta"]
    assert s.totals["tensor_bytes"] == sum(tensors)
    assert s.totals["file_bytes"] == sum(files)
    # v0's files are new to the node, v1 and v3 change none, v2 changes the tokenizer
    assert s.totals["new_file_bytes"] == files[0] + len(TOKENIZER_V2)
    assert s.totals["dense_bytes"] == 4 * full
    assert s.bytes_saved == sum(full - t for t in tensors[1:])  # deltas, on tensors
    last = s.applied[-1]
    assert (last["tensor_bytes"], last["file_bytes"], last["new_file_bytes"]) == (
        tensors[3], files[3], 0)
    for _ in range(60):  # more than the 50 `applied` keeps
        s._applied(ms[3], 0.1)
    assert s.totals["versions"] == 64 and len(s.applied) == 50
    assert s.totals["tensor_bytes"] == sum(tensors) + 60 * tensors[3]
