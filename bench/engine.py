"""From verified blocks to a serving engine (issue 19): a Llama-shaped bf16 model (default about
1B parameters, as bench/scale.py builds it), about 1 % of elements changed per version, through
real daemons and a real rollout worker (the built-in torch engine) on loopback. Every time is a
ratio to one comparison scan of the whole model timed in the same run.

    python bench/engine.py [--params 1e9 | --small] [--versions 4] [--direct-positions N]
                           [--json]

Figures: serve_over_scan (a region daemon holding every verified block of version N until its
torch engine serves N, median over the deltas, divided by one scan); first_apply_cold_s (a region
daemon started with an empty NUMBA_CACHE_DIR: its first delta, blocks verified -> patched and
verified for its engines; `first_apply_cold_disk_s` -> on disk); small_delta_serve_s (the default
tiny model, deltas well under 1 MB, regions bootstrapping in a chain of 3 hops, each with a worker:
publish -> every region's engine serving, median); region_disk_over_model (bytes the engine-first
region wrote per version, downloads included, amortized over the versions, over the model's
bytes); all_verified; vllm_* from bench/engine_vllm.py's `measure` when that exists.
`delta_bytes` (median per version) is printed beside serve_over_scan: `--direct-positions`
trades them (how the trainer codes positions, chain.codec.api.DIRECT).
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.scale import Child, choose_shape, code_rev, console, llama_size  # noqa: E402

WORK = Path(__file__).resolve().parent / "engine_work.py"
GOALS = {"serve_over_scan": 1.5, "first_apply_cold_s": 10.0, "small_delta_serve_s": 1.0,
         "region_disk_over_model": 0.5}


def vllm_figures(params: float, density: float, work: Path) -> dict:
    """bench/engine_vllm.py's measure, or nulls and the reason where vLLM cannot run here
    (no .venv-vllm: `make vllm-env`), so the other figures are still printed."""
    from bench.engine_vllm import measure
    from rollout.vllm_launch import VllmLaunchError

    try:
        got = measure(params, density, work)
    except VllmLaunchError as e:
        return {"vllm_params": None, "vllm_reload_over_update": None, "vllm_error": str(e)}
    return {"vllm_params": got["vllm_params"],
            "vllm_reload_over_update": got["vllm_reload_over_update"], "vllm": got}


def run(args: argparse.Namespace, work: Path) -> dict:
    hidden, layers = choose_shape(args.params)
    params = llama_size(hidden, layers)
    model = 2 * params
    cfg = {"hidden": hidden, "layers": layers, "versions": args.versions, "batch": args.batch,
           "density": args.density, "seed": args.seed, "timeout": args.timeout,
           "small_versions": args.small_versions, "e2e_timeout": args.timeout,
           "direct_positions": args.direct_positions}
    (work / "config.json").write_text(json.dumps(cfg))
    load0 = os.getloadavg()
    console.print(f"model: hidden {hidden}, {layers} layers, {params / 1e9:.3f}B params; "
                  f"{args.versions} delta versions; code {code_rev()}; load {load0[0]:.1f}")
    Child("gen", work, [str(ROOT / "bench" / "scale_work.py"), "gen", str(work)]).run()
    Child("hf", work, [str(WORK), "hf", str(work)]).run()
    before = Child("baseline", work, [str(ROOT / "bench" / "scale_work.py"), "baseline",
                                      str(work)]).run().results[0]
    serve = Child("serve", work, [str(WORK), "serve", str(work)]).run().results[0]
    small = Child("small", work, [str(WORK), "small", str(work)]).run().results[0]
    scan = before["scan_s"]
    rows = serve["rows"]
    med = statistics.median(r["serve_s"] for r in rows)
    cold = serve["cold_first"]
    out = {
        "params": params, "model_bytes": model, "density": statistics.mean(
            c / before["elements"] for c in before["changed"]),
        "code": code_rev(), "scan_s": scan, "serve_s": med, "serve_over_scan": med / scan,
        "serve_s_all": [r["serve_s"] for r in rows],
        "decode_s_all": [r["decoded_s"] for r in rows],
        "patch_written_s_all": [r["patch_written_s"] for r in rows],
        "direct_positions": args.direct_positions,
        "delta_bytes": statistics.median(r["delta_bytes"] for r in rows),
        "publish_to_serve_s": statistics.median(r["publish_to_serve_s"] for r in rows),
        "first_apply_cold_s": cold.get("patch_written_s"),
        "first_apply_cold_disk_s": cold.get("disk_current_s"),
        "small_delta_serve_s": small["median_s"],
        "small_delta_bytes": statistics.median(r["delta_bytes"] for r in small["rows"]),
        "region_disk_over_model": serve["disk_bytes"] / args.versions / model,
        "disk_batch_versions": args.batch,
        "all_verified": bool(serve["digests_ok"] and serve["engine_ok"]),
        **vllm_figures(args.params, args.density, work),
        "load_average": os.getloadavg()[0], "load_average_start": load0[0],
    }
    g = [("serve / scan", "serve_over_scan", f"{med:.2f}s; {out['delta_bytes'] / 1e6:.1f} MB "
          f"deltas (direct_positions {args.direct_positions})"),
         ("first apply, cold cache (s)", "first_apply_cold_s", "disk "
          f"{out['first_apply_cold_disk_s']}s"),
         ("small delta, 3 hops (s)", "small_delta_serve_s",
          f"{out['small_delta_bytes']:.0f} B deltas"),
         ("region disk / model / version", "region_disk_over_model",
          f"batch {args.batch}")]
    for label, key, also in g:
        v = out[key]
        ok = v is not None and v <= GOALS[key]
        console.print(f"{label}: {v if v is None else round(v, 3)} (goal <= {GOALS[key]}) "
                      f"{'PASS' if ok else 'MISS'}; {also}")
    console.print(f"vLLM: {out['vllm_params']} params, reload/update "
                  f"{out['vllm_reload_over_update']} (goal >= 5); all verified "
                  f"{out['all_verified']}; load average {out['load_average']:.1f} (start "
                  f"{load0[0]:.1f})")
    if out.get("vllm"):
        v = out["vllm"]
        console.print(f"this host's memory, one core: copy / scatter {v['bound_copy_over_scatter']}"
                      f", copy / (scatter + check) {v['bound_copy_over_patch_check']} (a reload "
                      "copies the model; the update scatters the changes and checks the words)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=1e9)
    ap.add_argument("--small", action="store_true", help="a ~50M-parameter quick run")
    ap.add_argument("--versions", type=int, default=4, help="delta versions (x batch)")
    ap.add_argument("--batch", type=int, default=4, help="the region's disk_batch_versions")
    ap.add_argument("--small-versions", type=int, default=10)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--direct-positions", type=int, default=-1,
                    help="the trainer's direct_positions_pct (chain.codec.api.DIRECT): -1 the "
                    "compact default, 1000 codes nearly every segment's positions directly")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    args = ap.parse_args()
    if args.small:
        args.params = 5e7
    if args.versions < 3 or args.versions % args.batch:
        ap.error("--versions must be at least 3 and a multiple of --batch")
    work = Path(tempfile.mkdtemp(prefix="engine-", dir=args.workdir))
    try:
        out = run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
