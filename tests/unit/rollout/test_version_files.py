"""What the vLLM backend reads from a version directory (rollout/version_files.py): a directory
that is not the named version, or whose files disagree with its VERSION.json, is refused with
the reason; the in-place scatter writes exactly the listed elements."""

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from chain.digest import state_digest, tensor_digest
from chain.safetensors_io import TensorFiles
from chain.versiondir import VersionInfo, write_info
from rollout.version_files import read_target, scatter


def version_dir(tmp_path: Path, version: int, state: dict[str, torch.Tensor],
                listed: list[str] | None = None) -> Path:
    d = tmp_path / f"v{version:08d}"
    d.mkdir()
    save_file(state, str(d / "model.safetensors"))
    digests = {n: tensor_digest("bfloat16", list(state[n].shape) if n in state else [1],
                                state[n].view(torch.int16).numpy().reshape(-1).view("uint16")
                                if n in state else np.zeros(1, np.uint16))
               for n in (listed or list(state))}
    write_info(d, VersionInfo(version, state_digest(digests), "t", digests), None)
    return d


def state() -> dict[str, torch.Tensor]:
    return {"a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4).bfloat16(),
            "b.weight": torch.ones(5).bfloat16()}


def test_a_version_directory_gives_every_tensors_digest_shape_and_dtype(tmp_path: Path) -> None:
    t = read_target(version_dir(tmp_path, 7, state()), 7)
    assert t.shapes == {"a.weight": (3, 4), "b.weight": (5,)}
    assert t.dtypes == {"a.weight": torch.bfloat16, "b.weight": torch.bfloat16}
    assert set(t.digests) == {"a.weight", "b.weight"}


def test_a_directory_of_another_version_is_refused(tmp_path: Path) -> None:
    d = version_dir(tmp_path, 7, state())
    with pytest.raises(ValueError, match="holds version 7, not 8"):
        read_target(d, 8)
    with pytest.raises(ValueError, match="not a finished deltaswarm version"):
        read_target(tmp_path, 7)


def test_files_that_disagree_with_version_json_are_refused(tmp_path: Path) -> None:
    d = version_dir(tmp_path, 7, state(), listed=["a.weight", "c.weight"])
    with pytest.raises(ValueError, match=r"disagree.*'b\.weight'.*'c\.weight'"):
        read_target(d, 7)


def test_scatter_writes_only_the_listed_elements_of_a_fused_block(tmp_path: Path) -> None:
    d = version_dir(tmp_path, 7, state())
    bits = TensorFiles(d).bits("a.weight")
    fused = torch.full((5, 4), -1.0)  # rows 1..3 hold a.weight, in float32 as vLLM may serve
    block = fused.narrow(0, 1, 3)
    moved = scatter(block.view(-1), bits, np.array([0, 5, 11]), torch.bfloat16)
    assert moved == 3 * (2 + 8)
    want = torch.full((5, 4), -1.0)
    want.view(-1)[[4 + 0, 4 + 5, 4 + 11]] = torch.tensor([0.0, 5.0, 11.0])
    assert torch.equal(fused, want)
    scatter(block.reshape(-1), bits, None, torch.bfloat16)
    assert torch.equal(fused[1:4], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert torch.equal(fused[0], torch.full((4,), -1.0))
