"""An adapter region's check before it fetches anything (Syncer._check_base): the run it
serves, the kind of version, and the base its daemon holds as current."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from chain.adapters import ADAPTER_CONFIG, BaseNotHeld, pin_for
from daemon.versions.sync import Syncer
from tests.unit.chain.test_adapters import CONFIG, adapter_state, keyfiles, publish_base
from trainer.publisher import Publisher

__all__ = ["keyfiles"]  # the fixture, used by name



def test_an_adapter_region_checks_run_kind_and_base_before_fetching(keyfiles: Path):
    """Syncer._check_base, on the three manifests it must refuse and the one it takes."""
    tmp = keyfiles
    base_m, base_w = publish_base(tmp)
    pub = Publisher(tmp / "lora-chain", tmp / "lora.key", run="run-a", base=pin_for(base_m))
    adapter_m = pub.publish(0, adapter_state(0), files={ADAPTER_CONFIG: CONFIG}).snapshot

    took = SimpleNamespace(adapters=True, adapter_base=base_w.root, adapter_run="run-a",
                           base_problem="stale", base_held=None)
    Syncer._check_base(took, adapter_m)
    assert took.base_problem is None and took.base_held["path"] == str(base_w.current().path)
    for m, over, why in ((base_m, {}, "run 'base'; this daemon serves run 'run-a'"),
                         (base_m, {"adapter_run": None}, "is a full-model version"),
                         (adapter_m, {"adapters": False, "adapter_run": None},
                          "no adapter.base_weights")):
        node = SimpleNamespace(**{"adapters": True, "adapter_base": base_w.root,
                                  "adapter_run": "run-a", "base_problem": None,
                                  "base_held": None, **over})
        with pytest.raises(BaseNotHeld, match=re.escape(why)):
            Syncer._check_base(node, m)
        assert why in node.base_problem
