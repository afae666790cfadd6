"""Reading safetensors headers: a truncated or malformed file is refused with ChainError naming
the tensor, instead of a KeyError or a short view."""

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from chain.errors import ChainError
from chain.safetensors_io import TensorFiles


def _write(tmp_path: Path) -> Path:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
               "b": torch.ones(5)}, str(path))
    return path


def _with_header(path: Path, edit) -> Path:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    body = json.dumps(header).encode()
    out = path.with_name("edited.safetensors")
    out.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])
    return out


def test_a_valid_file_reads_every_tensor(tmp_path: Path) -> None:
    files = TensorFiles(_write(tmp_path))
    assert files.names() == ["a", "b"]
    assert files.bits("a").size == 12 and files.bits("b").size == 5


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path)
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(ChainError, match="truncated or corrupt"):
        TensorFiles(path)


@pytest.mark.parametrize("edit", [
    lambda h: h.__setitem__("a", "not an object"),
    lambda h: h["a"].pop("dtype"),
    lambda h: h["a"].__setitem__("data_offsets", [0]),
    lambda h: h["a"].__setitem__("shape", [3, "4"]),
    lambda h: h["a"].__setitem__("data_offsets", [0, 7]),
    lambda h: h["a"].__setitem__("dtype", "C64"),
])
def test_a_malformed_header_entry_is_refused(tmp_path: Path, edit) -> None:
    with pytest.raises(ChainError, match="tensor a"):
        TensorFiles(_with_header(_write(tmp_path), edit))


def test_a_header_seen_before_is_reused_only_for_the_same_bytes_and_size(tmp_path: Path) -> None:
    """Headers are parsed once per layout (a cache keyed by the header's bytes and the data's
    size): a file cut short after a good read is still refused, and readers get their own
    slot tables."""
    path = _write(tmp_path)
    first, second = TensorFiles(path), TensorFiles(path)
    assert first.slots == second.slots and first.slots is not second.slots
    first.slots.pop("a")
    assert TensorFiles(path).names() == ["a", "b"]
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(ChainError, match="truncated or corrupt"):
        TensorFiles(path)


def test_advice_for_many_tensors_covers_each_once_per_run_of_neighbours(tmp_path, monkeypatch):
    """Tensors next to each other in the file take one madvise; given out of file order they
    take more calls, never fewer bytes; empty tensors none."""
    from chain import safetensors_io as sio

    path = tmp_path / "m.safetensors"
    names = [f"t{i:02d}" for i in range(12)]
    state = {n: torch.full((1000 + 37 * i,), float(i), dtype=torch.bfloat16)
             for i, n in enumerate(names)}
    state["t05"] = torch.zeros(0, dtype=torch.bfloat16)
    save_file(state, str(path))
    files = TensorFiles(path)
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(sio, "_advise_range",
                        lambda m, start, end, advice: calls.append((start, end)))

    def covered(picked: list[str]) -> None:
        want = {b for n in picked for b in range(files.slots[n].start, files.slots[n].end)}
        got = {b for lo, hi in calls for b in range(lo, hi)}
        assert want <= got and all(hi > lo for lo, hi in calls)

    files.release_many(names)
    assert len(calls) == 1
    covered(names)
    calls.clear()
    picked = ["t00", "t01", "t03", "t04", "t05", "t06", "t11"]  # gaps at t02, t07..t10
    files.prefault_many(picked)
    assert len(calls) == 3
    covered(picked)
    calls.clear()
    files.release_many(names[::-1])
    assert 1 < len(calls) <= len(names)
    covered(names)


def _mapped_kib(path: Path) -> int:
    """This process's resident KiB of its mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
            inside = line.endswith(str(path))
        elif inside and head[0] == "Rss:":
            total += int(head[1])
    return total


def _kernel_populates() -> bool:
    """Whether this kernel knows MADV_POPULATE_READ, asked of a map of our own (not through
    the code under test, so a wrong address there fails the test instead of skipping it)."""
    import mmap

    from chain import safetensors_io as sio

    probe = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        probe.madvise(sio.MADV_POPULATE_READ, 0, mmap.PAGESIZE)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def test_advice_reaches_the_tensors_own_pages_and_keeps_their_bytes(tmp_path: Path) -> None:
    """madvise goes through libc (the GIL let go) at the map's own address: populating a
    tensor maps its pages into this process, releasing unmaps them, and its bytes stay."""
    from chain import safetensors_io as sio

    if not Path("/proc/self/smaps").exists() or sio._MADVISE is None:
        pytest.skip("needs Linux's /proc/self/smaps and libc's madvise")
    if not _kernel_populates():
        pytest.skip("this kernel has no MADV_POPULATE_READ (Linux 5.14+)")
    path = tmp_path / "big.safetensors"
    big = torch.arange(1 << 22, dtype=torch.int32)  # 16 MiB
    save_file({"big": big, "small": torch.ones(3)}, str(path))
    files = TensorFiles(path)
    files.release_many(["big"])
    before = _mapped_kib(path)
    files.prefault_many(["big"])
    populated = _mapped_kib(path)
    # the tensor's pages (a populate at a wrong address is ignored: too few), not more
    assert 16 * 1024 - 8 <= populated - before <= 16 * 1024 + 8
    files.release_many(["big"])
    assert _mapped_kib(path) <= before + 8
    assert torch.equal(torch.from_numpy(files.bits("big").view("int32").copy()), big)


def test_a_failed_release_is_an_error_and_a_failed_populate_is_not(tmp_path, monkeypatch):
    """Populating is only a speed-up (older kernels refuse it); a DONTNEED that fails would
    leave the footprint unbounded, so it raises, naming the call."""
    import ctypes
    import errno

    from chain import safetensors_io as sio

    files = TensorFiles(_write(tmp_path))

    def refuse(addr: int, length: int, advice: int) -> int:
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(sio, "_MADVISE", refuse)
    files.prefault_many(["a", "b"])
    with pytest.raises(OSError, match="DONTNEED"):
        files.release_many(["a"])
