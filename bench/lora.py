"""LoRA runs: what an adapter version costs on the wire, and how fast vLLM serves it.

Part 1 (always): a Llama-shaped model (`--hidden`, `--layers`) gets a PEFT LoRA (`--rank`, every
linear layer) trained for `--steps` AdamW steps at `--lr` on arithmetic text (causal LM loss), and
each step's adapter is published through a real Publisher pinned to the base (chain/adapters.py).
Per version: the delta's bytes (tensor payload, what crosses the swarm) over the bf16 adapter's
bytes, and the share of adapter elements whose bf16 bits changed. LoRA changes densely (Adam
moves every element by about the learning rate each step), so this is the codec's dense case.

Part 2 (`--vllm`, needs .venv-vllm): the base through a base trainer and region daemon, two runs
each through their own trainer and region daemon (engine `vllm_lora`) into one `vllm serve
--enable-lora` on the base. Per version: publish call -> the region's hook reports vLLM serving
it (`serve_s`), against vLLM's own load_lora_adapter of the same adapter from local disk
(`load_s`, a fresh name each time) measured in the same run.

    python bench/lora.py [--hidden 512 --layers 4 --rank 16 --steps 12 --lr 2e-4] [--vllm] [--json]

Last line with --json: adapter_bytes, delta_over_adapter, changed_share, serve_over_load,
runs_served (the last two with --vllm only), and the settings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402

from chain import keys  # noqa: E402
from chain.adapters import pin_for  # noqa: E402
from chain.policy import SnapshotPolicy  # noqa: E402
from rollout.tasks.arithmetic import make_task  # noqa: E402
from trainer.lora import adapter_files, adapter_state, base_state  # noqa: E402
from trainer.model import build_default_model, hf_files  # noqa: E402
from trainer.publisher import Publisher  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GOALS = {"delta_over_adapter": 0.5, "serve_over_load": 3.0, "runs_served": 2}


def lora_model(a: argparse.Namespace, seed: int):
    model, tok = build_default_model(hidden=a.hidden, layers=a.layers, heads=a.hidden // 64,
                                     kv_heads=max(1, a.hidden // 128), max_positions=64)
    torch.manual_seed(seed)
    peft = get_peft_model(model, LoraConfig(r=a.rank, lora_alpha=2 * a.rank,
                                            target_modules=TARGETS, lora_dropout=0.0))
    return model, peft, tok


def batches(tok, seed: int, size: int = 16):
    """Causal-LM batches of "prompt answer" arithmetic lines."""
    task, rng = make_task(), random.Random(seed)
    while True:
        lines = [p + (task.reference(p) or "") for p in task.sample_prompts(rng, size)]
        enc = tok(lines, return_tensors="pt", padding=True)
        labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
        yield enc.input_ids, enc.attention_mask, labels


def train_steps(peft, tok, a: argparse.Namespace, seed: int, steps: int | None = None):
    """Yield the adapter (bf16, PEFT names) after each of `steps` AdamW steps."""
    opt = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=a.lr,
                            weight_decay=0.0)
    data = batches(tok, seed)
    peft.train()
    for _ in range(a.steps if steps is None else steps):
        ids, mask, labels = next(data)
        loss = peft(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield adapter_state(peft), loss.item()


def coding(a: argparse.Namespace, tmp: Path) -> dict:
    model, peft, tok = lora_model(a, 0)
    keys.generate(tmp / "base.key")
    keys.generate(tmp / "run.key")
    base_pub = Publisher(tmp / "base", tmp / "base.key", run="base")
    pin = pin_for(base_pub.publish(0, base_state(peft), hf_files(model, tok)).snapshot)
    pub = Publisher(tmp / "run", tmp / "run.key", run="run", base=pin,
                    snapshots=SnapshotPolicy(every=10_000))
    files = adapter_files(peft)
    first = adapter_state(peft)
    adapter_bytes = sum(t.numel() * t.element_size() for t in first.values())
    pub.publish(0, first, files)
    rows, last = [], first
    for v, (state, loss) in enumerate(train_steps(peft, tok, a, seed=1), start=1):
        out = pub.publish(v, state, files)
        changed = sum(int((state[k].view(torch.int16) != last[k].view(torch.int16)).sum())
                      for k in state)
        rows.append({"version": v, "loss": round(loss, 4), "delta_bytes": out.delta_tensor_bytes,
                     "over_adapter": round(out.delta_tensor_bytes / adapter_bytes, 4),
                     "changed_share": round(changed / out.elements, 4),
                     "publish_s": round(out.seconds, 4)})
        last = state
        if not a.json:
            r = rows[-1]
            print(f"v{v}: loss {loss:.3f}  delta {out.delta_tensor_bytes / 1e6:.3f} MB = "
                  f"{r['over_adapter']:.3f}x adapter  changed {r['changed_share']:.1%}",
                  flush=True)
    return {"adapter_bytes": adapter_bytes, "adapter_tensors": len(first),
            "delta_over_adapter": statistics.median(r["over_adapter"] for r in rows),
            "changed_share": statistics.median(r["changed_share"] for r in rows), "rows": rows}


def _post(url: str, body: dict) -> float:
    t0 = time.perf_counter()
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()
    return time.perf_counter() - t0


def serving(a: argparse.Namespace, tmp: Path) -> dict:
    from daemon.engines.lora import versions_listed
    from rollout.vllm_launch import VllmLaunchConfig, start
    from rollout.vllm_server import VllmServerHook
    from tests.integration.harness import Cluster
    from tests.support import wait_until

    model, peft, tok = lora_model(a, 0)
    runs = ("run-a", "run-b")
    server = None
    with Cluster(tmp / "base", run="base") as base, Cluster(tmp / "a", run=runs[0]) as ca, \
            Cluster(tmp / "b", run=runs[1]) as cb:
        try:
            base.trainer()
            base_region = base.region("base-r")
            base.start_all()
            snap = base.publisher().publish(0, base_state(peft), hf_files(model, tok)).snapshot
            base.wait_all_at(0, 120)
            weights = base_region.state_dir / "weights"
            server = start(VllmLaunchConfig(
                model=(weights / "current").resolve(), transfer_backend=None, max_model_len=64,
                max_lora_rank=max(8, a.rank)), log_path=tmp / "vllm.log")
            regions = {}
            for name, c in zip(runs, (ca, cb), strict=True):
                regions[name] = c.lora_run(name, weights, server.base_url)
                c.publisher().base = pin_for(snap)
            files = adapter_files(peft)
            serve_s, load_s, phases = [], [], []
            steps = train_steps(peft, tok, a, seed=2, steps=a.serve_versions)
            for v in range(a.serve_versions):
                state = adapter_state(peft) if v == 0 else next(steps)[0]
                for name, c in zip(runs, (ca, cb), strict=True):
                    t0, wall0 = time.perf_counter(), time.time()
                    assert c.publisher().publish(v, state, files).notified
                    published = time.perf_counter() - t0
                    region = regions[name]
                    wait_until(lambda r=region, v=v: (r.status().get("adapter") or {})
                               .get("engine_version") == v, 120, f"{name} serving v{v}")
                    if name == runs[0]:
                        serve_s.append(time.perf_counter() - t0)
                        status = region.status()
                        applied = next(x for x in status["detail"]["sync"]["applied"]
                                       if x["version"] == v)
                        phases.append({"publish_s": published,
                                       "to_current_s": applied["time"] - wall0 - published,
                                       "engine_load_s": status["adapter"]["load_s"]})
                # vLLM's own load of this very adapter from local disk, under a fresh name
                local = tmp / f"local-{v}"
                shutil.copytree(regions[runs[0]].state_dir / "lora" / runs[0] / f"v{v:08d}", local)
                load_s.append(_post(server.base_url + "/v1/load_lora_adapter",
                                    {"lora_name": f"direct-{v}", "lora_path": str(local)}))
                _post(server.base_url + "/v1/unload_lora_adapter", {"lora_name": f"direct-{v}"})
                if not a.json:
                    print(f"serve v{v}: publish->serving {serve_s[-1]:.3f}s, vLLM's own load "
                          f"{load_s[-1] * 1000:.1f} ms", flush=True)
            with urllib.request.urlopen(server.base_url + "/v1/models", timeout=30) as r:
                listed = versions_listed(json.loads(r.read()))
            last = a.serve_versions - 1
            answering = [n for n in runs if listed.get(n) == last and asyncio.run(
                VllmServerHook(server.base_url, model=n).generate(["1+1="], max_tokens=4))]
        finally:
            if server is not None:
                server.stop()
    return {"serve_s": statistics.median(serve_s), "load_s": statistics.median(load_s),
            "serve_over_load": statistics.median(serve_s) / statistics.median(load_s),
            "runs_served": len(answering),
            "serve_phases_median_s": {k: round(statistics.median(p[k] for p in phases), 4)
                                      for k in phases[0]},
            "serve_rows": [{"version": i, "serve_s": round(s, 4), "load_s": round(ld, 5)}
                           for i, (s, ld) in enumerate(zip(serve_s, load_s, strict=True))]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--lr", type=float, default=2e-4,
                    help="AdamW learning rate (LoRA's is ~10x full fine-tuning's)")
    ap.add_argument("--vllm", action="store_true", help="also time serving through vLLM")
    ap.add_argument("--serve-versions", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    out: dict = {"hidden": a.hidden, "layers": a.layers, "rank": a.rank, "steps": a.steps,
                 "lr": a.lr, "optimizer": "AdamW", "loadavg": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        out |= coding(a, Path(tmp) / "coding")
        if a.vllm:
            out |= serving(a, Path(tmp) / "serving")
    out["goals"] = {k: {"goal": g, "value": out.get(k), "met": None if out.get(k) is None else
                        (out[k] >= g if k == "runs_served" else out[k] <= g)}
                    for k, g in GOALS.items()}
    if not a.json:
        for k, g in out["goals"].items():
            print(f"{k}: {g['value']} (goal {g['goal']}): "
                  f"{'n/a' if g['met'] is None else 'PASS' if g['met'] else 'MISS'}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
