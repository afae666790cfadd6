"""DeltaswarmCallback on a real Publisher and chain dir (the Trainer's callback calls are made
directly): v0 at train start, one version per `every` optimizer steps, only on the main
process, and a restart resumes only from weights bit-identical to the head."""

from types import SimpleNamespace

import pytest
import torch

from chain import keys
from chain.errors import ChainError
from chain.sources import StateDictSource, source_digest
from trainer.hf_callback import DeltaswarmCallback
from trainer.model import build_default_model
from trainer.publisher import Publisher


def _pub(tmp_path) -> Publisher:
    if not (tmp_path / "k").exists():
        keys.generate(tmp_path / "k")
    return Publisher(tmp_path / "chain", tmp_path / "k", run="r")


def _nudge(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05)


def test_publishes_v0_then_every_nth_step_on_the_main_process_only(tmp_path):
    model, tok = build_default_model(0, hidden=32, layers=1, heads=2)
    pub = _pub(tmp_path)
    cb = DeltaswarmCallback(pub, every=2)
    main = SimpleNamespace(is_world_process_zero=True, global_step=0)
    other = SimpleNamespace(is_world_process_zero=False, global_step=2)
    cb.on_train_begin(None, main, None, model=model, processing_class=tok)
    assert pub.head == 0 and {"config.json", "tokenizer.json"} <= set(cb.files)
    for step in (1, 2):
        _nudge(model)
        main.global_step = step
        cb.on_step_end(None, main, None, model=model)
    cb.on_step_end(None, other, None, model=model)
    assert [p.version for p in cb.published] == [0, 1]
    m = pub.store.get(1, "delta")
    assert m.state_digest == source_digest(StateDictSource(cb.weights(model)))


def test_a_restart_resumes_only_from_the_heads_weights(tmp_path):
    model, tok = build_default_model(0, hidden=32, layers=1, heads=2)
    state = SimpleNamespace(is_world_process_zero=True, global_step=0)
    DeltaswarmCallback(_pub(tmp_path)).on_train_begin(None, state, None, model=model,
                                                      processing_class=tok)
    _nudge(model)
    with pytest.raises(ChainError, match="not v0 as published"):
        DeltaswarmCallback(_pub(tmp_path)).on_train_begin(None, state, None, model=model,
                                                          processing_class=tok)
    fresh, _ = build_default_model(0, hidden=32, layers=1, heads=2)
    cb = DeltaswarmCallback(_pub(tmp_path))
    cb.on_train_begin(None, state, None, model=fresh, processing_class=tok)
    state.global_step = 1
    cb.on_step_end(None, state, None, model=model)
    assert [p.version for p in cb.published] == [1]


def test_every_must_be_positive():
    with pytest.raises(ValueError, match="every must be at least 1"):
        DeltaswarmCallback(object(), every=0)
