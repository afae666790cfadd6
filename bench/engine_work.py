"""The measured runs of bench/engine.py, each in its own process (so a JIT cache, memory and the
daemons it starts are its own). Not meant to be run by hand:

    python bench/engine_work.py ROLE WORKDIR     # ROLE: hf serve small

hf: the HF files (config, tokenizer) of the Llama shape bench/scale_work.py generates.
serve: a trainer daemon, a region daemon (engine first) with a real rollout worker (the torch
  engine), and a second region started with an empty numba cache; per version, seconds from the
  region holding every verified block to its engine serving it, and the region's disk writes.
small: the default tiny model, versions of a few KB-MB, regions bootstrapping in a chain of 3
  hops, each with a worker; publish -> every region's engine serving.
"""

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.scale_work import RUN, VOCAB, load, mark  # noqa: E402
from chain.policy import SnapshotPolicy  # noqa: E402
from tests.integration.harness import TOKEN, Cluster, step  # noqa: E402
from trainer.publisher import Publisher  # noqa: E402

BIG = {"bittorrent": {"piece_size": 1 << 20}}


def role_hf(work: Path, cfg: dict) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.model import build_char_tokenizer, hf_files

    tok = build_char_tokenizer()
    h = cfg["hidden"]
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=h, intermediate_size=4 * h,
                         num_hidden_layers=cfg["layers"], num_attention_heads=h // 64,
                         num_key_value_heads=h // 256, tie_word_embeddings=False,
                         max_position_embeddings=256, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    (work / "hf").mkdir(exist_ok=True)
    for name, data in hf_files(model, tok).items():
        (work / "hf" / name).write_bytes(data)
    mark(result={"files": sorted(os.listdir(work / "hf"))})


def hf(work: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((work / "hf").iterdir())}


class Worker:
    def __init__(self, root: Path, url: str, name: str, threads: int = 2) -> None:
        self.log = open(root / f"{name}.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollout.worker", "--daemon", url, "--token", TOKEN,
             "--worker", name, "--prompts-per-batch", "1", "--group-size", "1",
             "--max-tokens", "1", "--pace-per-version", "1", "--pace-ahead", "0",
             "--poll-timeout-s", "30", "--threads", str(threads)],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=self.log,
            stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def phases(d) -> dict[int, dict]:
    ef = d.status()["detail"]["sync"]["engine_first"] or {"versions": []}
    return {p["version"]: p for p in ef["versions"]}


def served(d, version: int, engine: str) -> dict | None:
    return phases(d).get(version, {}).get("served", {}).get(engine)


def wait(pred, timeout: float, what: str, interval: float = 0.25):
    """Poll `pred` until it returns something true. The figures are the daemons' own
    timestamps, so the interval sets no resolution; polling every 50 ms (status documents
    from every daemon) took CPU from the decode being measured."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(interval)
    raise SystemExit(f"timed out waiting for {what}")


def write_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        io = dict(line.split(":") for line in f)
    return int(io["write_bytes"]) - int(io["cancelled_write_bytes"])


def role_serve(work: Path, cfg: dict) -> None:
    files = hf(work)
    cold = Path(tempfile.mkdtemp(prefix="numba-cold-", dir=work))
    with Cluster(work / "serve", run=RUN) as c:
        t = c.trainer(**BIG)
        r1 = c.region("r1", sync={"disk_batch_versions": cfg["batch"], "disk_idle_s": 3600},
                      **BIG)
        c.start_all()
        pub = Publisher(chain_dir=t.state_dir / "chain", key_path=c.key_path, run=RUN,
                        daemon_url=t.url, token=TOKEN,
                        snapshots=SnapshotPolicy(every=10**6, max_delta_ratio=1e9),
                        direct_positions=cfg["direct_positions"])
        worker = None
        try:
            out = pub.publish(0, load(work, 0), files)
            c.wait_all_at(0, cfg["timeout"], ["r1"])
            worker = Worker(work, r1.url, "w1")
            wait(lambda: served(r1, 0, "w1"), cfg["timeout"], "the worker to load v0", 0.3)
            print("serve: v0 on both regions, worker serving", flush=True)
            w0 = write_bytes(r1.proc.pid)
            rows = []
            for v in range(1, cfg["versions"] + 1):
                state = load(work, v)
                t0 = time.time()
                out = pub.publish(v, state, files)
                publish_s = time.time() - t0
                del state
                s = wait(lambda v=v: served(r1, v, "w1"), cfg["timeout"], f"w1 serving v{v}")
                ph = phases(r1)[v]
                rows.append({"version": v, "publish_s": publish_s, "serve_s": s["s"],
                             "delta_bytes": out.delta_bytes,
                             "how": s["how"],
                             "decoded_s": ph.get("decoded_s"),
                             "patch_written_s": ph.get("patch_written_s"),
                             "publish_to_serve_s": s["at"] - t0})
                print(f"serve: v{v} served by the engine {s['s']:.2f}s after its blocks "
                      f"verified ({s['how']})", flush=True)
            last = cfg["versions"]
            # versions is a multiple of the batch: the last one sets off the disk catch-up
            c.wait_all_at(last, cfg["timeout"], ["r1"])
            disk_bytes = write_bytes(r1.proc.pid) - w0
            want = (out.delta or out.snapshot).state_digest
            worker.stop()
            worker = None
            # a region started later on an empty numba cache: its first delta (v1, after the
            # v0 snapshot), blocks verified -> patched for its engines, and -> on disk
            print("serve: starting a region with an empty numba cache", flush=True)
            r2 = c.region("cold", **BIG)
            r2.start(env_extra={"NUMBA_CACHE_DIR": str(cold)})
            r2.wait_ready(cfg["timeout"])
            c.wait_all_at(last, cfg["timeout"], ["cold"])
            cold_ph = phases(r2).get(1, {})
            digests = {n: c.daemons[n].status()["state_digest"] for n in ("r1", "cold")}
            mark(result={"rows": rows, "disk_bytes": disk_bytes, "cold_first": cold_ph,
                         "digests_ok": all(d == want for d in digests.values()),
                         "engine_ok": all(r["how"] == "patch" for r in rows)})
        finally:
            if worker is not None:
                worker.stop()


def role_small(work: Path, cfg: dict) -> None:
    from trainer.model import build_default_model, hf_files, state_dict_as

    model, tok = build_default_model(seed=0)
    files = hf_files(model, tok)
    state = state_dict_as(model, torch.bfloat16)
    with Cluster(work / "small", run=RUN) as c:
        t = c.trainer()
        r1 = c.region("h1")
        r2 = c.region("h2", bootstrap=[r1.url])
        r3 = c.region("h3", bootstrap=[r2.url])
        c.start_all()
        pub = Publisher(chain_dir=t.state_dir / "chain", key_path=c.key_path, run=RUN,
                        daemon_url=t.url, token=TOKEN,
                        snapshots=SnapshotPolicy(every=10**6, max_delta_ratio=1e9),
                        direct_positions=cfg["direct_positions"])
        regions = [r1, r2, r3]
        workers = [Worker(work, r.url, f"s{i}", threads=1) for i, r in enumerate(regions)]
        try:
            pub.publish(0, state, files)
            c.wait_all_at(0, cfg["timeout"])
            for i, r in enumerate(regions):
                wait(lambda r=r, i=i: served(r, 0, f"s{i}"), cfg["timeout"], "workers at v0",
                     0.3)
            rows = []
            for v in range(1, cfg["small_versions"] + 1):
                state = step(state, v, cfg["density"])
                t0 = time.time()
                out = pub.publish(v, state, files)
                ats = [wait(lambda r=r, i=i, v=v: served(r, v, f"s{i}"), cfg["timeout"],
                            f"s{i} serving v{v}")["at"] for i, r in enumerate(regions)]
                m = out.delta
                rows.append({"version": v, "delta_bytes": m.payload_bytes,
                             "serve_s": max(ats) - t0})
                print(f"small: v{v} ({m.payload_bytes} B) served in every region "
                      f"{max(ats) - t0:.2f}s after publish started", flush=True)
            mark(result={"rows": rows, "median_s": statistics.median(r["serve_s"]
                                                                     for r in rows)})
        finally:
            for w in workers:
                w.stop()


ROLES = {"hf": role_hf, "serve": role_serve, "small": role_small}

if __name__ == "__main__":
    role, workdir = sys.argv[1], Path(sys.argv[2])
    ROLES[role](workdir, json.loads((workdir / "config.json").read_text()))
    sys.stdout.flush()
    os._exit(0)
