"""vLLM worker extension: reload only the changed tensors of a version, or patch them in place.

Loaded into every vLLM worker by `--worker-extension-cls` (rollout.vllm_launch sets it) and called
over `POST /collective_rpc`. Imports only torch and safetensors (it runs inside
vLLM's venv); vllm itself is imported lazily, inside the methods that need it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PATCH_INDICES, PATCH_VALUES = "::indices", "::values"
CPU_CHECKPOINT_LAYOUT_ENV = "DELTASWARM_VLLM_CPU_CHECKPOINT_LAYOUT"


def keep_checkpoint_layout_on_cpu() -> None:
    """Make vLLM's CPU backend keep linear weights as plain tensors (torch F.linear) instead of
    repacking them for oneDNN/sgl kernels, as a GPU does; in-place patches then reach them.
    Slower GEMMs: for exercising the GPU patch path on CPU, not for serving."""
    from vllm.model_executor.layers import utils

    def plain_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    utils.dispatch_cpu_unquantized_gemm = plain_linear


def checkpoint_files(weights_path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, for a single-file or sharded HF directory."""
    index = weights_path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: weights_path / f for name, f in weight_map.items()}
    files = sorted(weights_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{weights_path} holds no *.safetensors files")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            out |= {name: f for name in sf.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    return out


def fused_group(name: str, packed: dict[str, list[str]]) -> str:
    """The vLLM module a checkpoint tensor is loaded into: q/k/v -> qkv_proj, gate/up -> gate_up.

    vLLM's layerwise reload processes a module only once every element of every parameter in it
    has been loaded; a module loaded in part gets uninitialised memory for the rest. So a
    changed tensor pulls in every tensor of its module (weights and biases alike).
    """
    module, _, _param = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    for fused, parts in packed.items():
        if leaf in parts:
            return f"{parent}.{fused}"
    return module


def expand_to_groups(changed: Iterable[str], available: Iterable[str],
                     packed: dict[str, list[str]]) -> list[str]:
    """Every available checkpoint name that shares a vLLM module with a changed one."""
    available = list(available)
    unknown = sorted(set(changed) - set(available))
    if unknown:
        raise KeyError(f"changed tensors not in the checkpoint: {unknown[:5]}")
    groups = {fused_group(n, packed) for n in changed}
    return sorted(n for n in available if fused_group(n, packed) in groups)


def read_tensors(files: dict[str, Path],
                 names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(files[n], []).append(n)
    for f, group in by_file.items():
        with safe_open(str(f), framework="pt") as sf:
            for n in group:
                yield n, sf.get_tensor(n)


def write_patch(path: Path, changes: dict[str, tuple[torch.Tensor, torch.Tensor, tuple]]) -> Path:
    """Write a sparse patch: name -> (flat int32/int64 indices, new values, full shape)."""
    tensors, shapes = {}, {}
    for name, (indices, values, shape) in changes.items():
        tensors[name + PATCH_INDICES] = indices.contiguous()
        tensors[name + PATCH_VALUES] = values.contiguous()
        shapes[name] = list(shape)
    save_file(tensors, str(path), metadata={"shapes": json.dumps(shapes)})
    return path


def read_patch(patch_path: Path, device: torch.device) -> list[Any]:
    """A sparse patch file: per tensor `NAME::indices` (int32/64) and `NAME::values`, with
    `{"shapes": {NAME: [dims]}}` in the safetensors metadata. Returns CheckpointWeightPatch-es."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch

    with safe_open(str(patch_path), framework="pt", device=str(device)) as sf:
        meta = sf.metadata() or {}
        if "shapes" not in meta:
            raise ValueError(f"{patch_path}: metadata lacks 'shapes'; not a deltaswarm patch")
        shapes = json.loads(meta["shapes"])
        patches = []
        for name, shape in sorted(shapes.items()):
            values = sf.get_tensor(name + PATCH_VALUES)
            patches.append(CheckpointWeightPatch(
                name=name, shape=tuple(shape), dtype=values.dtype, values=values,
                indices=sf.get_tensor(name + PATCH_INDICES)))
    return patches


if os.environ.get(CPU_CHECKPOINT_LAYOUT_ENV) == "1":  # set by the launcher; read at worker start
    keep_checkpoint_layout_on_cpu()


class DeltaswarmWorkerExtension:
    """Mixed into vLLM's Worker; `self` is the worker (self.model_runner, self.reload_weights)."""

    def _model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def deltaswarm_info(self) -> dict[str, Any]:
        model = self._model()
        params = dict(model.named_parameters())
        linear = {type(m).__name__: getattr(m.cpu_linear, "__name__", "?")
                  for m in model.modules() if hasattr(m, "cpu_linear")}
        emptied = [n for n, p in params.items() if p.numel() == 0]
        return {
            "model": type(model).__name__,
            "patchable": not emptied,
            "device": str(next(iter(params.values())).device),
            "dtypes": sorted({str(p.dtype) for p in params.values()}),
            "packed_modules_mapping": dict(getattr(model, "packed_modules_mapping", {})),
            "empty_params": sorted(emptied)[:8],
            "cpu_linear": linear,
        }

    def reload_changed(self, weights_path: str, names: list[str] | str,
                       group_fused: bool = True) -> dict[str, Any]:
        """Reload from `weights_path` only the modules whose tensors are in `names`.

        `names` may be a JSON list (collective_rpc passes strings). `group_fused=False` loads
        exactly `names` (to show what goes wrong when a fused group is split).
        """
        t0 = time.perf_counter()
        changed = json.loads(names) if isinstance(names, str) else list(names)
        files = checkpoint_files(Path(weights_path))
        packed = dict(getattr(self._model(), "packed_modules_mapping", {}))
        load = expand_to_groups(changed, files, packed) if group_fused else sorted(changed)
        weights = list(read_tensors(files, load))
        t1 = time.perf_counter()
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return {"changed": len(changed), "loaded": load,
                "bytes": sum(t.numel() * t.element_size() for _, t in weights),
                "read_s": t1 - t0, "apply_s": time.perf_counter() - t1}

    def _refuse_kernel_layout(self) -> None:
        emptied = [n for n, p in self._model().named_parameters() if p.numel() == 0]
        if emptied:
            raise NotImplementedError(
                f"in-place patch impossible: vLLM repacked {len(emptied)} weights into kernel "
                f"layout (e.g. {emptied[0]}; vLLM's CPU backend does this); use reload_changed")

    def stage_patch(self, patch_path: str) -> dict[str, Any]:
        """Read a sparse patch onto the model's device while still serving (no pause needed)."""
        self._refuse_kernel_layout()
        t0 = time.perf_counter()
        device = next(self._model().parameters()).device
        patches = read_patch(Path(patch_path), device)
        self._deltaswarm_staged = (patch_path, patches)
        return {"staged": len(patches), "elements": sum(p.values.numel() for p in patches),
                "stage_s": time.perf_counter() - t0}

    @torch.no_grad()
    def apply_patch(self, patch_path: str) -> dict[str, Any]:
        """Apply a sparse element patch in place through vLLM's checkpoint-weight-patch API
        (staged by `stage_patch` for the same path, else read now).

        Works where the model keeps its parameters in checkpoint layout (GPU, unquantized).
        On CPU, vLLM repacks linear weights for oneDNN/sgl kernels and empties `weight`, so the
        patch has nothing to write into: this raises before writing anything.
        """
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            load_checkpoint_weight_patches,
        )

        self._refuse_kernel_layout()
        staged = getattr(self, "_deltaswarm_staged", None)
        self._deltaswarm_staged = None
        if staged is None or staged[0] != patch_path:
            staged = (patch_path, read_patch(Path(patch_path),
                                             next(self._model().parameters()).device))
        patches = staged[1]
        t0 = time.perf_counter()
        loaded = load_checkpoint_weight_patches(self._model(), patches)
        return {"patched": len(patches), "loaded": sorted(loaded),
                "elements": sum(p.values.numel() for p in patches),
                "apply_s": time.perf_counter() - t0}

    @torch.no_grad()
    def deltaswarm_param_bits(self, names: list[str] | str) -> dict[str, dict[str, Any]]:
        """Live parameters' bytes (hex), dtype and shape, for tests and audits that compare the
        served weights with a checkpoint independently of the backend's own check."""
        wanted = json.loads(names) if isinstance(names, str) else list(names)
        params = dict(self._model().named_parameters())
        out = {}
        for n in wanted:
            p = params[n].detach().to("cpu").contiguous()
            out[n] = {"dtype": str(p.dtype).removeprefix("torch."), "shape": list(p.shape),
                      "hex": p.view(-1).view(torch.uint8).numpy().tobytes().hex()}
        return out

    @torch.no_grad()
    def deltaswarm_poke(self, name: str, index: int, add: float) -> float:
        """Add `add` to element `index` of live parameter `name` behind every check's back
        (fault injection for tests); returns the new value."""
        flat = dict(self._model().named_parameters())[name].data.view(-1)
        flat[index] += add
        return float(flat[index])
