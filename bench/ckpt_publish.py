"""Memory and time of publishing HF checkpoint directories (trainer.checkpoints, what `deltaswarm
publish/watch` run) against the in-process Publisher fed the same checkpoints loaded whole, in
the same run, each in a fresh process (peak resident memory = VmHWM of that process).

Writes two sharded bf16 checkpoints of --mb MiB (the second with --density of the elements
changed), then per method: publish step 1 (v0, a snapshot) and step 2 (v1, a delta).

    python bench/ckpt_publish.py [--mb 512] [--density 0.01]
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
method, work = sys.argv[2], Path(sys.argv[3])
from chain import codec  # noqa: F401  (numba JIT warm-up is not publishing)
t0 = time.perf_counter()
if method == "checkpoints":
    from trainer.checkpoints import CheckpointPublisher, inspect_checkpoint
    pub = CheckpointPublisher(work / f"chain-{method}", work / "k", "bench", work / "pubstate")
    for n in (1, 2):
        pub.publish(inspect_checkpoint(work / f"step_{n}"), step=n)
else:
    from safetensors.torch import load_file
    from trainer.publisher import Publisher
    pub = Publisher(work / f"chain-{method}", work / "k", "bench")
    for v, n in enumerate((1, 2)):
        d = work / f"step_{n}"
        state = {}
        for f in sorted(d.glob("*.safetensors")):
            state.update(load_file(str(f)))
        pub.publish(v, state)
        del state
hwm = next(int(line.split()[1]) for line in open("/proc/self/status")
           if line.startswith("VmHWM:"))  # this process's own peak (ru_maxrss keeps the parent's)
print(json.dumps({"seconds": time.perf_counter() - t0, "peak_mib": hwm / 1024}))
"""


def write_checkpoints(work: Path, mib: int, density: float) -> None:
    import torch
    from safetensors.torch import save_file

    from chain import keys

    keys.generate(work / "k")
    per = 16 << 20  # 16 MiB tensors (8 M bf16 elements)
    n = max(2, mib * (1 << 20) // per)
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": (torch.randn(per // 2, generator=g) * 0.02).bfloat16()
             .view(2048, -1) for i in range(n)}
    for step in (1, 2):
        d = work / f"step_{step}"
        d.mkdir()
        (d / "config.json").write_text('{"model_type": "llama"}')
        names = sorted(state)
        half = len(names) // 2
        shards = {"model-00001-of-00002.safetensors": names[:half],
                  "model-00002-of-00002.safetensors": names[half:]}
        for fname, part in shards.items():
            save_file({k: state[k] for k in part}, str(d / fname))
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
        for k, t in state.items():  # the next step: `density` of the elements move a bit
            bits = t.view(torch.int16).clone()
            bits[torch.rand(bits.shape, generator=g) < density] += 1
            state[k] = bits.view(torch.bfloat16)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mb", type=int, default=512)
    p.add_argument("--density", type=float, default=0.01)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        work = Path(tmp)
        write_checkpoints(work, a.mb, a.density)
        model = sum(f.stat().st_size for f in (work / "step_1").glob("*.safetensors")) / 2**20
        out = {}
        for method in ("checkpoints", "state_dict"):
            r = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), method, str(work)],
                               capture_output=True, text=True, check=True)
            out[method] = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"model {model:.0f} MiB, 2 versions (snapshot + {100 * a.density:g} % delta)")
    for method, r in out.items():
        print(f"  {method:<12} peak RSS {r['peak_mib']:7.0f} MiB ({r['peak_mib'] / model:.2f}x "
              f"the model)  {r['seconds']:6.1f} s")
    ratio = out["state_dict"]["peak_mib"] / out["checkpoints"]["peak_mib"]
    print(f"checkpoint publishing peaks at 1/{ratio:.1f} of the in-process Publisher's memory")


if __name__ == "__main__":
    started = time.time()
    main()
    print(f"({time.time() - started:.0f} s in all)")
