"""Run by test_vllm_transfer_engine in .venv-vllm: the `deltaswarm` backend class, without a
vLLM server, on a small vLLM-shaped model and real version directories. Prints one JSON line
of what each step did (or the error it raised)."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import torch
from safetensors.torch import save_file
from vllm.config.weight_transfer import WeightTransferConfig

from chain.digest import state_digest
from chain.versiondir import VersionInfo, write_changes, write_info
from rollout.engine_check import digest_of
from rollout.vllm_transfer import DeltaswarmWeightTransferEngine


class Model(torch.nn.Module):
    """q/k/v fused into qkv_proj, as vLLM's Llama holds them."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.attn = torch.nn.Module()
        qkv = torch.cat([state[f"attn.{x}_proj.weight"] for x in "qkv"])
        self.attn.qkv_proj = torch.nn.Module()
        self.attn.qkv_proj.weight = torch.nn.Parameter(qkv.clone(), requires_grad=False)
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(state["norm.weight"].clone(), requires_grad=False)


def version_dir(root: Path, version: int, state: dict[str, torch.Tensor],
                changes: dict | None) -> Path:
    d = root / f"v{version:08d}"
    d.mkdir(parents=True)
    save_file(state, str(d / "model.safetensors"))
    digests = {n: digest_of(t) for n, t in state.items()}
    write_info(d, VersionInfo(version, state_digest(digests), "probe", digests), None)
    if changes is not None:
        write_changes(d, version, changes)
    return d


def main(root: Path) -> None:
    g = torch.Generator().manual_seed(0)
    v0 = {"attn.q_proj.weight": torch.randn(8, 4, generator=g).bfloat16(),
          "attn.k_proj.weight": torch.randn(4, 4, generator=g).bfloat16(),
          "attn.v_proj.weight": torch.randn(4, 4, generator=g).bfloat16(),
          "norm.weight": torch.randn(4, generator=g).bfloat16()}
    v1 = dict(v0)
    v1["attn.k_proj.weight"] = v0["attn.k_proj.weight"].clone()
    v1["attn.k_proj.weight"].view(-1)[[3, 9]] += 1.0
    v1["norm.weight"] = v0["norm.weight"] + 1.0
    weights = root / "weights"
    version_dir(weights, 1, v0, None)
    version_dir(weights, 2, v1, {"attn.k_proj.weight": torch.tensor([3, 9]).numpy(),
                                 "norm.weight": None})
    (root / "elsewhere").mkdir()
    version_dir(root / "elsewhere", 2, v1, None)
    (weights / "escape").symlink_to(root / "elsewhere" / "v00000002")
    model = Model(v0)
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(rank=0, data_parallel_index=0,
                                                          tensor_parallel_size=1),
                          model_config=SimpleNamespace(quantization=None))
    engine = DeltaswarmWeightTransferEngine(WeightTransferConfig(backend="deltaswarm"), cfg,
                                            torch.device("cpu"), model)
    engine.init_transfer_engine(engine.parse_init_info(
        {"weights_dir": str(weights), "report_dir": str(root / "reports")}))
    out: dict = {}

    def round_(label: str, info: dict) -> None:
        engine.start_weight_update()
        try:
            engine.update_weights(info)
        except (ValueError, TypeError) as e:
            out[label] = {"error": str(e)}
            engine.session = None
            return
        engine.finish_weight_update()
        report = json.loads((root / "reports" / "dp0-rank0.json").read_text())
        out[label] = {"mode": report["mode"], "ok": report["check"]["ok"],
                      "mismatched": report["check"]["mismatched"],
                      "loaded": report["loaded_tensors"], "ticket": report["ticket"]}

    round_("bad_mode", {"version": 2, "mode": "sideways"})
    round_("wrong_version", {"version": 2, "path": str(weights / "v00000001")})
    round_("outside", {"version": 2, "path": str(root / "elsewhere" / "v00000002")})
    round_("dotdot", {"version": 2, "path": str(weights / ".." / "elsewhere" / "v00000002")})
    round_("symlink_out", {"version": 2, "path": str(weights / "escape")})
    round_("version_true", {"version": True, "mode": "check"})
    round_("version_zero", {"version": 0, "mode": "check"})
    round_("version_negative", {"version": -1, "mode": "check"})
    try:
        engine.init_transfer_engine(engine.parse_init_info({"weights_dir": str(root)}))
    except ValueError as e:
        out["move_weights_dir"] = {"error": str(e)}
    round_("patch_unknown_base", {"version": 2, "mode": "patch"})
    round_("check_v0", {"version": 1, "mode": "check", "ticket": "a"})
    round_("patch_v1", {"version": 2, "ticket": "b"})
    out["qkv_after"] = model.attn.qkv_proj.weight.view(torch.int16).tolist()
    out["qkv_v1"] = torch.cat([v1[f"attn.{x}_proj.weight"] for x in "qkv"]) \
        .view(torch.int16).tolist()
    with torch.no_grad():
        model.attn.qkv_proj.weight[13, 0] += 2.0  # v_proj row 1, behind the engine's back
    round_("check_after_tamper", {"version": 2, "mode": "check", "ticket": "c"})
    print(json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
