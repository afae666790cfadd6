"""vLLM plugin entry point (`vllm.general_plugins` in pyproject.toml): registers the
`deltaswarm` weight-transfer backend, so a stock `vllm serve --weight-transfer-config
'{"backend": "deltaswarm"}'` finds it. vLLM calls `register` in every process it starts (API
server, engine core, workers); it is cheap (the backend module is imported only when a worker
creates the engine) and safe to call twice.
"""

from __future__ import annotations

import os

BACKEND = "deltaswarm"
CPU_CHECKPOINT_LAYOUT_ENV = "DELTASWARM_VLLM_CPU_CHECKPOINT_LAYOUT"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "rollout.vllm_transfer", "DeltaswarmWeightTransferEngine")
    except ValueError as e:  # registered already (the plugin ran twice in this process)
        if "already registered" not in str(e):
            raise
    if os.environ.get(CPU_CHECKPOINT_LAYOUT_ENV) == "1":
        from rollout.vllm_ext import keep_checkpoint_layout_on_cpu

        keep_checkpoint_layout_on_cpu()
