"""Shared fixture: two versions of the default model as real HF directories (v0 and v1).

Torch runs single-threaded here: the tiny model gains nothing from threads, and on a loaded
2-core CI box oversubscribed torch threads made these tests 10-50x slower."""

from pathlib import Path

import pytest
import torch

from trainer.model import build_default_model, save_hf_dir

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def hf_versions(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("weights")
    model, tok = build_default_model(seed=0)
    v0 = save_hf_dir(model, tok, root / "v00000000")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    v1 = save_hf_dir(model, tok, root / "v00000001")
    return {0: v0, 1: v1}
