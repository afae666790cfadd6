"""The `deltaswarm` weight-transfer backend for vLLM's RL API (vLLM 0.32: vllm/distributed/
weight_transfer, the /start_weight_update, /update_weights, /finish_weight_update routes).

A stock `vllm serve MODEL --weight-transfer-config '{"backend": "deltaswarm"}'` (with
VLLM_SERVER_DEV_MODE=1, which vLLM asks for its RL routes) finds it through the
`vllm.general_plugins` entry point (rollout.vllm_plugin). The transfer is local: the region
daemon on the same host has already received and verified the version into its weights
directory, so `update_weights` only names it, and each worker reads what changed from there.

One round, as the daemon's vllm hook drives it (daemon/engines/vllm.py):
  /init_weight_transfer_engine {"init_info": {"weights_dir": W, "report_dir": R}}
  /pause?mode=keep, /start_weight_update,
  /update_weights {"update_info": {"version": N, "path": P, "mode": "auto", "ticket": T}},
  /finish_weight_update {"weight_version": "N"}: vLLM's post-load processing (repacking,
  re-quantization) runs here, then every worker reads its weights back and compares them with
  the version's digests (rollout/engine_check.py); it writes R/<worker>.json for ticket T.
  A mismatch makes the daemon run another round with mode "full"; then /resume.

Patch files (issue 19): `update_info: {"version": N, "patch": P}` names the region's patch file
(chain/patchfile.py: per changed tensor its positions, new values, parent and new digests).
Each element is written in place through the model loader's own layout (rollout/vllm_patch.py:
fused q/k/v and gate/up, TP slices), and each tensor's digest is moved from the 64-bit words
the patch touched, read back from the device before and after: the check costs O(changes).
A whole read-back runs when the update asks for it (`"full_check": true`, which the daemon sets
on a schedule and on request). Tensors whose layout vLLM changed after loading (quantized,
or vLLM CPU's repacked linear weights unless DELTASWARM_VLLM_CPU_CHECKPOINT_LAYOUT=1) are
reloaded by module instead, and the report says so (mode `patch+reload`, `reason`).

Inputs are confined (issue 20, finding 11): `path` and `patch` must resolve (symlinks followed)
inside the weights directory or the patches directory set at init, with no `..`; a directory
set at init cannot be changed later (restart vLLM to move it); `version` is an int >= 1.

Modes: `patch` writes only the changed elements in place (scattered straight into the live
tensors the check can locate, else vLLM's checkpoint-weight-patch API; needs the engine at N-1,
the version's CHANGES file, and unquantized weights in checkpoint layout: GPU, or CPU with
DELTASWARM_VLLM_CPU_CHECKPOINT_LAYOUT=1); `changed` reloads, through vLLM's layerwise
reload, the modules whose tensors' digests differ from what the engine holds (whole fused
q/k/v and gate/up groups); `full` reloads everything; `check` only reads back; `auto` is patch
where possible, else changed. finish never raises for a mismatch: a raising finish would leave
vLLM's worker stuck in its update session; the report carries the verdict instead.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.checkpoint_weight_patch import (
    CheckpointWeightPatch,
    load_checkpoint_weight_patches,
)
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from chain.codec.api import map_jobs
from chain.digest import state_digest
from chain.dtypes import lookup as chain_dtype
from chain.patchfile import BadPatch, Patch, TensorPatch, read_patch
from chain.safetensors_io import TensorFiles
from chain.versiondir import read_changes
from chain.weights import version_dir_name
from rollout import engine_check
from rollout.version_files import Target, read_target, scatter
from rollout.vllm_ext import expand_to_groups, read_tensors
from rollout.vllm_patch import Maps, Patcher, TensorMap, TensorResult

MODES = ("auto", "patch", "changed", "full", "check")
log = logging.getLogger("deltaswarm.vllm_transfer")


@dataclass
class DeltaswarmInitInfo(WeightTransferInitInfo):
    weights_dir: str = ""
    """The local daemon's weights directory (its vNNNNNNNN version directories)."""
    report_dir: str = ""
    """Where each worker writes its round report (JSON); empty: no reports."""
    patches_dir: str = ""
    """Where the region leaves patch files, if not inside weights_dir."""


@dataclass
class DeltaswarmUpdateInfo(WeightTransferUpdateInfo):
    version: int
    path: str = ""
    """The verified version directory; default weights_dir/vNNNNNNNN."""
    mode: str = "auto"
    check: bool = True
    ticket: str = ""
    """Copied into the report, so the caller knows the report is this round's."""
    patch: str = ""
    """The region's patch file for this version (chain/patchfile.py), to patch in place."""
    full_check: bool = False
    """Also read every tensor back after this update (the scheduled / requested full check)."""

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) \
                or self.version < 1:
            raise ValueError(f"update_info.version must be a positive integer, not "
                             f"{self.version!r}")
        for key in ("path", "patch"):
            value = getattr(self, key)
            if not isinstance(value, str):
                raise ValueError(f"update_info.{key} must be a string path, not {value!r}")
            if ".." in Path(value).parts:
                raise ValueError(f"update_info.{key} {value!r} contains '..'; name the file "
                                 "by its path inside the weights directory")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")


@dataclass
class Session:
    """One start ... finish: what was asked and done, for the report."""

    started: float = field(default_factory=time.perf_counter)
    target: Target | None = None
    info: DeltaswarmUpdateInfo | None = None
    mode: str = ""
    layerwise: bool = False
    loaded: list[str] = field(default_factory=list)
    loaded_bytes: int = 0
    base: dict[str, str | None] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    patch: Patch | None = None
    results: list[TensorResult] = field(default_factory=list)
    reloaded: dict[str, torch.Tensor] = field(default_factory=dict)
    """patch mode: new checkpoint tensors loaded by module (not patchable in place)."""
    reason: str = ""
    """Why some tensors were reloaded by module instead of patched (empty: all patched)."""


class DeltaswarmWeightTransferEngine(WeightTransferEngine[DeltaswarmInitInfo,
                                                         DeltaswarmUpdateInfo]):
    """Loads verified versions from the local daemon's weights directory (see module doc)."""

    init_info_cls = DeltaswarmInitInfo
    update_info_cls = DeltaswarmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: WeightTransferConfig, vllm_config: Any, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.weights_dir: Path | None = None
        self.patches_dir: Path | None = None
        self.report_dir: Path | None = None
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.maps = Maps(model)
        self.loaded_version: int | None = None
        self.loaded: dict[str, str | None] = {}
        """checkpoint name -> digest the live weights are known to hold (None: unknown)."""
        self.session: Session | None = None
        pc = self.parallel_config
        self.worker = f"dp{getattr(pc, 'data_parallel_index', 0)}-rank{getattr(pc, 'rank', 0)}"
        self.tensor_parallel = getattr(pc, "tensor_parallel_size", 1) > 1
        # compile the digest kernels (numba) now, at vLLM's start, not inside the first update
        engine_check.digest_of(torch.zeros(8, dtype=torch.bfloat16))

    # ------------------------------------------------------------------ lifecycle

    def init_transfer_engine(self, init_info: DeltaswarmInitInfo) -> None:
        """Where versions and reports live; may be called again (e.g. after a daemon restart)."""
        if init_info.weights_dir:
            self.weights_dir = self._set_once("weights_dir", self.weights_dir,
                                              init_info.weights_dir)
        if init_info.patches_dir:
            self.patches_dir = self._set_once("patches_dir", self.patches_dir,
                                              init_info.patches_dir)
        if init_info.report_dir:
            self.report_dir = Path(init_info.report_dir)
            self.report_dir.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def _set_once(key: str, held: Path | None, given: str) -> Path:
        """A directory given at init: must exist; once set, a different one is refused (what
        update_weights may read is fixed when vLLM's daemon first speaks to it)."""
        if ".." in Path(given).parts:
            raise ValueError(f"{key} {given!r} contains '..'")
        wd = Path(given).resolve()
        if not wd.is_dir():
            raise ValueError(f"{key} {given} is not a directory")
        if held is not None and held != wd:
            raise ValueError(f"{key} is already {held}; refusing to move it to {wd} (restart "
                             "vLLM to serve another weights directory)")
        return wd

    def start_weight_update(self) -> None:
        """Opens a round. The layerwise reload starts in update_weights, once the mode is
        known: an in-place patch must find the weights where they are, not on the meta
        device where initialize_layerwise_reload puts them."""
        self.session = Session()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: DeltaswarmUpdateInfo) -> None:
        s = self.session
        if s is None:
            raise RuntimeError("update_weights without start_weight_update")
        s.info = update_info
        t0 = time.perf_counter()
        if update_info.patch and update_info.mode in ("auto", "patch"):
            self._receive_patch(s, update_info)
            s.seconds["load"] = time.perf_counter() - t0
            return
        if update_info.mode == "check" and not update_info.path \
                and self.loaded_version == update_info.version and self.shapes:
            s.mode = "check"  # against the digests tracked through the patches
            s.target = Target(update_info.version, self.weights_dir or Path("."),
                              {n: d for n, d in self.loaded.items() if d is not None},
                              dict(self.shapes), dict(self.dtypes), {})
            return
        path = self._path(update_info)
        target = read_target(path, update_info.version)
        s.target = target
        if update_info.mode == "check":
            s.mode = "check"
            return
        mode = update_info.mode
        changes = None
        if mode in ("auto", "patch"):
            changes, why = self._patch_plan(target)
            if changes is None and mode == "patch":
                raise ValueError(f"cannot patch v{target.version} in place: {why}")
            mode = "patch" if changes is not None else "changed"
        s.mode = mode
        if mode == "patch":
            self._apply_patch(s, target, changes)
        else:
            self._reload(s, target, full=mode == "full")
        s.seconds["load"] = time.perf_counter() - t0

    def finish_weight_update(self) -> None:
        s, self.session = self.session, None
        if s is None:
            return
        t0 = time.perf_counter()
        report: dict[str, Any] = {"check": None, "error": None, "reason": s.reason or None}
        try:
            if s.layerwise:
                # post-load processing (repacking, re-quantization) of the reloaded layers
                finalize_layerwise_reload(self.model, self.model_config)
                s.seconds["finalize"] = time.perf_counter() - t0
            if s.patch is not None:
                self._finish_patch(s, report)
            elif s.target is None:
                return
            else:
                result = self._verify(s) if s.info is not None and s.info.check else None
                self._remember(s, result)
                if result is not None:
                    report["check"] = result.summary()
                    s.seconds["check"] = result.seconds
        except Exception as e:
            # into the report, not out of finish: vLLM's worker would stay stuck in its update
            # session (every later start_weight_update refused); the daemon reloads in full
            self.loaded_version = None
            report["error"] = f"{type(e).__name__}: {e}"[:500]
        s.seconds["total"] = time.perf_counter() - s.started
        self._write_report(s, report)

    def shutdown(self) -> None:
        return None

    # ------------------------------------------------------------------ loading

    def _path(self, info: DeltaswarmUpdateInfo) -> Path:
        if info.path:
            return self._confined(info.path, "path")
        if self.weights_dir is None:
            raise ValueError("update_info has no path and init_weight_transfer_engine gave no "
                             "weights_dir")
        return self._confined(str(self.weights_dir / version_dir_name(info.version)), "path")

    def _confined(self, given: str, key: str) -> Path:
        """`given` resolved (symlinks followed), refused unless inside the weights directory
        (or, for a patch, the patches directory) set at init."""
        roots = [r for r in (self.weights_dir, self.patches_dir if key == "patch" else None)
                 if r is not None]
        if not roots:
            raise ValueError(f"update_info.{key} given before init_weight_transfer_engine set "
                             "a weights_dir")
        if ".." in Path(given).parts:
            raise ValueError(f"update_info.{key} {given!r} contains '..'")
        try:
            real = Path(given).resolve(strict=True)
        except (OSError, RuntimeError):
            raise ValueError(f"update_info.{key} {given} does not exist") from None
        if not any(real == r or real.is_relative_to(r) for r in roots):
            raise ValueError(f"update_info.{key} {given} resolves to {real}, outside "
                             f"{' and '.join(str(r) for r in roots)}; the backend reads only "
                             "what the local daemon verified")
        return real

    # ------------------------------------------------------------------ patch files

    def _receive_patch(self, s: Session, info: DeltaswarmUpdateInfo) -> None:
        """Patch in place from the region's patch file (see the module doc). Refuses, before
        writing anything, unless the engine holds the patch's parent."""
        ppath = self._confined(info.patch, "patch")
        if info.path:
            self._confined(info.path, "path")
        t0 = time.perf_counter()
        try:
            patch = read_patch(ppath)
        except BadPatch as e:
            raise ValueError(str(e)) from None
        s.seconds["read_patch"] = time.perf_counter() - t0
        if patch.version != info.version or patch.parent != info.version - 1:
            raise ValueError(f"{ppath} patches v{patch.parent} to v{patch.version}, not "
                             f"v{info.version - 1} to v{info.version}")
        why = self._base(patch)
        if why:
            raise ValueError(f"cannot patch v{info.version} in place: {why}")
        stale = [t.name for t in patch.tensors
                 if self.loaded.get(t.name) not in (t.parent_digest, None)]
        if stale:
            raise ValueError(f"cannot patch v{info.version} in place: the engine's "
                             f"{stale[:3]} are not v{patch.parent}'s")
        s.mode, s.patch = "patch", patch
        t1 = time.perf_counter()
        s.seconds["base"] = t1 - t0 - s.seconds["read_patch"]
        try:
            self._write_patch(s, info, patch)
            s.seconds["write_patch"] = time.perf_counter() - t1
        except BaseException:
            self.loaded_version = None  # written in part: only a full round can tell now
            raise

    def _write_patch(self, s: Session, info: DeltaswarmUpdateInfo, patch: Patch) -> None:
        quantized = bool(getattr(self.model_config, "quantization", None))
        patcher = Patcher(self.model, self.maps)
        slow: list[TensorPatch] = []
        ready: list[tuple[TensorMap, TensorPatch]] = []
        for tp in patch.tensors:
            dtype = chain_dtype(tp.dtype).torch_dtype
            shape = tuple(tp.shape)
            if self.shapes.get(tp.name, shape) != shape:
                raise ValueError(f"{tp.name}: the patch says shape {shape}, the engine holds "
                                 f"{self.shapes[tp.name]}")
            m = None if quantized else self.maps.get(tp.name, shape, dtype)
            if m is None or self.loaded.get(tp.name) is None:
                slow.append(tp)
                continue
            ready.append((m, tp))
            s.loaded_bytes += tp.indices.size * (8 + tp.values.itemsize)
        # tensors are independent (fused blocks are word-aligned row ranges): the host kernels
        # release the GIL, so the codec's threads share the walk, largest tensors first (a
        # pool of four made per update took 97-109 ms for 1 % of 1B bf16, these 82 ms)
        s.results = map_jobs(lambda a: patcher.apply(*a, check=info.check), ready,
                             lambda a: int(a[1].indices.size))
        s.loaded = sorted(t.name for t in patch.tensors)
        if slow:
            s.mode = "patch+reload"
            s.reason = (f"{len(slow)} of {len(patch.tensors)} tensors reloaded by module ("
                        + ("quantized weights" if quantized else
                           "vLLM changed their layout after loading (e.g. CPU's repacked linear "
                           "weights; DELTASWARM_VLLM_CPU_CHECKPOINT_LAYOUT=1 keeps them patchable)"
                           " or they cannot be read back") + f", e.g. {slow[0].name})")
            self._reload_from_patch(s, patch, slow)

    def _base(self, patch: Patch) -> str:
        """'' once the engine is known to hold v{parent}; else why not. An engine that does
        not know what it holds (after a start) reads every tensor back once against the verified
        parent directory, if the region still has it."""
        if self.loaded_version == patch.parent:
            return ""
        if self.loaded_version is not None:
            return f"the engine holds v{self.loaded_version}, not v{patch.parent}"
        if self.weights_dir is None:
            return "the engine does not know what it holds and has no weights_dir"
        pdir = self.weights_dir / version_dir_name(patch.parent)
        try:
            target = read_target(pdir, patch.parent)
        except (ValueError, OSError) as e:
            return f"the engine does not know what it holds and cannot check it: {e}"
        result = engine_check.check(self.model, target.version, target.digests, target.shapes,
                                    target.dtypes)
        if result.mismatched:
            return f"its weights are not v{patch.parent}'s (e.g. {result.mismatched[:3]})"
        self.loaded = dict(result.live)
        self.shapes, self.dtypes = dict(target.shapes), dict(target.dtypes)
        self.loaded_version = patch.parent
        return ""

    def _reload_from_patch(self, s: Session, patch: Patch, slow: list[TensorPatch]) -> None:
        """Module reload of the tensors that cannot be patched: their new values from the
        verified v{N} directory if the region has it, else the parent directory plus the patch;
        fused siblings come along (a module is reloaded whole)."""
        assert self.weights_dir is not None
        new_dir = self.weights_dir / version_dir_name(patch.version)
        old_dir = self.weights_dir / version_dir_name(patch.parent)
        try:
            src, pending = read_target(new_dir, patch.version), {}
        except ValueError:
            src = read_target(old_dir, patch.parent)
            pending = {t.name: t for t in patch.tensors}
        packed = dict(getattr(self.model, "packed_modules_mapping", {}) or {})
        load = expand_to_groups([t.name for t in slow], src.files, packed)
        if not s.layerwise:
            initialize_layerwise_reload(self.model)
            s.layerwise = True
        tensors = []
        for name, tensor in read_tensors(src.files, load):
            tp = pending.get(name)
            if tp is not None:
                tensor = tensor.clone()
                signed = tp.values.view(f"i{tp.values.itemsize}")
                tensor.view(-1)[torch.from_numpy(tp.indices)] = \
                    torch.from_numpy(signed).view(tensor.dtype)
            s.reloaded[name] = tensor
            tensors.append((name, tensor))
            s.loaded_bytes += tensor.numel() * tensor.element_size()
        try:
            self.model.load_weights(iter(tensors))
        except BaseException:
            finalize_layerwise_reload(self.model, self.model_config)
            s.layerwise = False
            self.loaded_version = None
            raise

    def _finish_patch(self, s: Session, report: dict[str, Any]) -> None:
        """The round's verdict: the incremental check of the patched tensors, the reloaded
        ones read back, the tracked digests against the patch's state digest, and the whole
        read-back when asked."""
        patch, info = s.patch, s.info
        assert patch is not None and info is not None
        t0 = time.perf_counter()
        want = {t.name: t.digest for t in patch.tensors}
        bad = [r.name for r in s.results if not r.ok]
        known = dict(self.loaded)
        for r in s.results:
            known[r.name] = r.digest if r.digest is not None else (want[r.name] if r.ok
                                                                   else None)
        unreadable: list[str] = []
        if s.reloaded or s.layerwise:
            # the layerwise reload re-ran post-load processing: read back what it loaded and
            # what was patched in place before it
            names = sorted(set(s.reloaded) | {r.name for r in s.results})
            live = engine_check.live_digests(self.model, self.shapes, self.dtypes, names)
            for n in names:
                expect = want.get(n, self.loaded.get(n))
                if live[n] is None:
                    unreadable.append(n)
                    known[n] = expect  # loaded this round; not readable here
                elif live[n] != expect:
                    bad.append(n)
                    known[n] = live[n]
                else:
                    known[n] = live[n]
        bad = sorted(set(bad))
        full = None
        if info.full_check:
            expected = {n: d for n, d in known.items() if d is not None}
            full = engine_check.check(self.model, patch.version, expected, self.shapes,
                                      self.dtypes)
            bad = sorted(set(bad) | set(full.mismatched))
            report["full"] = full.summary()
            s.seconds["full_check"] = full.seconds
        state_ok = None
        if all(d is not None for d in known.values()) and set(known) >= set(want):
            state_ok = state_digest({n: d for n, d in known.items() if d is not None}) \
                == patch.state_digest
        checked = sum(r.ok for r in s.results)
        report["check"] = {
            "kind": "incremental", "ok": (not bad and state_ok is not False) if info.check
            else None, "checked": checked, "mismatched": bad[:20],
            "mismatched_count": len(bad), "unreadable": unreadable[:20],
            "unreadable_count": len(unreadable), "state_digest_ok": state_ok,
            "elements": sum(r.elements for r in s.results),
            "words": sum(r.words for r in s.results), "seconds": time.perf_counter() - t0,
            "checked_bytes": sum(r.words for r in s.results) * 8}
        s.seconds["check"] = time.perf_counter() - t0
        self.loaded = known
        self.loaded_version = None if bad or state_ok is False else patch.version
        if s.layerwise:
            self.maps = Maps(self.model)

    def _patchable(self) -> str:
        """Why elements cannot be written in place here ('' if they can)."""
        if getattr(self.model_config, "quantization", None):
            return "quantized weights need the layerwise reload"
        emptied = [n for n, p in self.model.named_parameters() if p.numel() == 0]
        if emptied:
            return f"vLLM repacked {len(emptied)} weights into kernel layout (e.g. {emptied[0]})"
        return ""

    def _patch_plan(self, t: Target) -> tuple[dict | None, str]:
        if self.loaded_version != t.version - 1:
            held = "no verified version" if self.loaded_version is None \
                else f"v{self.loaded_version}"
            return None, f"the engine holds {held}, not v{t.version - 1}"
        why = self._patchable()
        if why:
            return None, why
        changes = read_changes(t.path, t.version)
        if changes is None:
            return None, f"{t.path} has no usable CHANGES file for v{t.version}"
        stale = [n for n in t.digests if n not in changes and self.loaded.get(n) != t.digests[n]]
        if stale:
            return None, f"tensors outside CHANGES differ from what the engine holds: {stale[:3]}"
        return changes, ""

    def _apply_patch(self, s: Session, t: Target, changes: dict) -> None:
        """Write the changed elements in place. Where the check can locate a tensor in the live
        model (unsharded, unquantized, checkpoint layout) they are scattered straight into it,
        reading only those elements from the memory-mapped file: cost follows the change, not
        the model. Anything else goes through vLLM's checkpoint-weight-patch API (which also
        handles TP shards, but builds a dense NaN-masked tensor per patched tensor)."""
        files = TensorFiles(t.path)
        params = dict(self.model.named_parameters())
        runtime = {n: tuple(p.shape) for n, p in params.items()}
        packed = dict(getattr(self.model, "packed_modules_mapping", {}) or {})
        via_vllm = []
        with torch.no_grad():
            for name in sorted(changes):
                loc = None if self.tensor_parallel else engine_check.locate(
                    name, t.shapes, runtime, packed)
                block = None
                if loc is not None and params[loc.param].numel():
                    p = params[loc.param].data
                    block = p if loc.whole else p.narrow(0, loc.start, loc.rows)
                if block is None or not block.is_contiguous():
                    via_vllm.append(name)
                    continue
                s.loaded_bytes += scatter(block.view(-1), files.bits(name),
                                                changes[name], t.dtypes[name])
        if via_vllm:
            self._patch_through_vllm(s, t, {n: changes[n] for n in via_vllm})
        s.loaded = sorted(changes)

    def _patch_through_vllm(self, s: Session, t: Target, changes: dict) -> None:
        dense, sparse = [], []
        for name, tensor in read_tensors(t.files, sorted(changes)):
            flat = tensor.reshape(-1)
            pos = changes[name]
            if pos is None:
                dense.append(CheckpointWeightPatch(name, t.shapes[name], tensor.dtype, flat))
                continue
            idx = torch.from_numpy(pos.astype("int64"))
            values = flat[idx]
            if values.is_floating_point() and bool(torch.isnan(values).any()):
                raise ValueError(f"{name}: a NaN value cannot be patched through vLLM (its patch "
                                 "marks unchanged elements with NaN); use mode changed")
            sparse.append(CheckpointWeightPatch(name, t.shapes[name], tensor.dtype,
                                                values.to(self.device), idx.to(self.device)))
            s.loaded_bytes += values.numel() * (values.element_size() + 8)
        for group in (dense, sparse):
            if group:
                load_checkpoint_weight_patches(self.model, group)
        s.loaded_bytes += sum(p.values.numel() * p.values.element_size() for p in dense)

    def _reload(self, s: Session, t: Target, full: bool) -> None:
        if full:
            names = sorted(t.digests)
        else:
            s.base = dict(self.loaded) if self.loaded_version is not None else self._readback(t)
            names = sorted(n for n in t.digests if s.base.get(n) != t.digests[n])
        if not names:
            return
        packed = dict(getattr(self.model, "packed_modules_mapping", {}) or {})
        load = expand_to_groups(names, t.files, packed)
        if not s.layerwise:
            initialize_layerwise_reload(self.model)
            s.layerwise = True
        sizes: list[int] = []

        def counted():
            for name, tensor in read_tensors(t.files, load):
                sizes.append(tensor.numel() * tensor.element_size())
                yield name, tensor

        try:
            self.model.load_weights(counted())
        except BaseException:
            # put the untouched layers back from their kept tensors: serving must not meet
            # meta tensors; what was half loaded is caught by the check and reloaded in full
            finalize_layerwise_reload(self.model, self.model_config)
            s.layerwise = False
            self.loaded_version = None
            raise
        s.loaded, s.loaded_bytes = load, sum(sizes)

    def _readback(self, t: Target) -> dict[str, str | None]:
        if self.tensor_parallel:
            return {}
        return engine_check.live_digests(self.model, t.shapes, t.dtypes)

    # ------------------------------------------------------------------ proof

    def _verify(self, s: Session) -> engine_check.CheckResult:
        t = s.target
        assert t is not None
        if self.tensor_parallel:
            return engine_check.CheckResult(version=t.version, ok=None,
                                            unreadable=sorted(t.digests))
        return engine_check.check(self.model, t.version, t.digests, t.shapes, t.dtypes)

    def _remember(self, s: Session, result: engine_check.CheckResult | None) -> None:
        """What the live weights hold now: read back where readable; elsewhere the target's
        digest if this round loaded the tensor or it was already right, else unknown."""
        t = s.target
        assert t is not None
        touched = set(s.loaded) if s.mode != "full" else set(t.digests)
        before = s.base or self.loaded
        known: dict[str, str | None] = {}
        for n, want in t.digests.items():
            live = result.live.get(n) if result is not None else want
            if live is None:
                live = want if (n in touched or before.get(n) == want) else None
            known[n] = live
        self.loaded = known
        self.shapes, self.dtypes = dict(t.shapes), dict(t.dtypes)
        bad = result is not None and (result.mismatched or result.ok is False)
        self.loaded_version = None if bad else t.version
        if s.layerwise:
            self.maps = Maps(self.model)

    def _write_report(self, s: Session, extra: dict[str, Any]) -> None:
        if self.report_dir is None or s.info is None or (s.target is None and s.patch is None):
            return
        doc = {"ticket": s.info.ticket, "worker": self.worker, "version": s.info.version,
               "path": str(s.target.path) if s.target else s.info.patch, "mode": s.mode,
               "loaded_tensors": len(s.loaded), "loaded_bytes": s.loaded_bytes,
               "total_tensors": len(s.target.digests) if s.target else len(self.shapes),
               "seconds": {k: round(v, 6) for k, v in s.seconds.items()}, "time": time.time(),
               **extra}
        out = self.report_dir / f"{self.worker}.json"
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, out)
        except OSError as e:  # the daemon sees no report and reloads in full; never raise here
            log.warning("cannot write the weight-update report %s: %s", out, e)
