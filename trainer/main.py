"""The reference trainer: async GRPO that publishes every step through the swarm.

    deltaswarm train --config run.yaml

Loop: take a batch of trajectories from the ingest store (filled over HTTP by the daemons'
forwarders) → one GRPO step on the fp32 master weights → checkpoint → publish the bf16 weights
as version N (a sparse delta, plus a snapshot per policy). A restart resumes from the last
published version: checkpoints are kept for the last two versions, so a crash between
checkpoint and publish is repaired by republishing from them; each checkpoint records how many
ingested trajectories it has trained on, so none is trained twice after such a crash.
"""

import argparse
import asyncio
import json
import logging
import sys
import threading
import time
from pathlib import Path

from aiohttp import web

log = logging.getLogger("deltaswarm.trainer")


def _checkpoints(state_dir: Path) -> dict[int, Path]:
    return {int(p.stem.split("-v")[1]): p for p in state_dir.glob("ckpt-v*.pt")}


def _prune(state_dir: Path, keep: int = 2) -> None:
    ck = _checkpoints(state_dir)
    for v in sorted(ck)[:-keep]:
        ck[v].unlink(missing_ok=True)
        _consumed_path(state_dir, v).unlink(missing_ok=True)


def _consumed_path(state_dir: Path, version: int) -> Path:
    """How many ingested trajectories the checkpoint of `version` has trained on."""
    return state_dir / f"ckpt-v{version}.consumed"


def _read_consumed(state_dir: Path, version: int) -> int | None:
    path = _consumed_path(state_dir, version)
    return int(path.read_text()) if path.exists() else None


class IngestThread:
    """The ingest endpoint's aiohttp server on its own event loop, beside the torch loop."""

    def __init__(self, app_factory, host: str, port: int) -> None:
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(app_factory())
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._host, self._port = host, port
        self._thread = threading.Thread(target=self._run, name="ingest", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self._host, self._port)
            self._loop.run_until_complete(site.start())
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise SystemExit(f"ingest endpoint: cannot listen on {self._host}:{self._port} "
                             f"(ingest.host/ingest.port): {self._error}")

    def call(self, coro):
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def run(cfg_path: Path) -> int:
    from trainer.config import load_trainer_config

    cfg = load_trainer_config(cfg_path)
    import torch

    from chain import keys
    from chain.atomic import write_atomic
    from chain.policy import Retention, SnapshotPolicy
    from trainer.grpo import GRPOConfig, GRPOTrainer
    from trainer.ingest import IngestStore, make_ingest_app
    from trainer.model import build_default_model, hf_files
    from trainer.publisher import Publisher
    from trainer.warmup import evaluate, resolve_task, warmup

    torch.manual_seed(cfg.model.seed)
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    if not cfg.key.exists():
        keys.generate(cfg.key)
    metrics_path = cfg.state_dir / "metrics.jsonl"

    def emit(rec: dict) -> None:
        rec = {"time": time.time(), **rec}
        with open(metrics_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    task = resolve_task(cfg.task)
    if cfg.model.path is None:
        model, tokenizer = build_default_model(cfg.model.seed, hidden=cfg.model.hidden,
                                               layers=cfg.model.layers, heads=cfg.model.heads)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(cfg.model.path, torch_dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    files = hf_files(model, tokenizer)
    grpo = GRPOConfig(lr=cfg.grpo.lr, is_cap=cfg.grpo.is_cap, max_staleness=cfg.grpo.max_staleness,
                      grad_clip=cfg.grpo.grad_clip, temperature=cfg.grpo.temperature,
                      adam_eps=cfg.grpo.adam_eps)
    pub = Publisher(cfg.chain_dir, cfg.key, cfg.run, cfg.daemon.url, cfg.daemon.token,
                    snapshots=SnapshotPolicy(every=cfg.snapshot_every),
                    retention=Retention(versions=cfg.retention_versions),
                    block_size=cfg.block_size, direct_positions=cfg.direct_positions_pct,
                    group_below=cfg.group_below)
    trainer = GRPOTrainer(model, grpo, version=0, pad_id=tokenizer.pad_token_id)

    ckpts = _checkpoints(cfg.state_dir)
    head = pub.head
    if head is None:
        t0 = time.perf_counter()
        before = evaluate(model, tokenizer, task, n=200)
        w = warmup(model, tokenizer, task, steps=cfg.warmup.steps, lr=cfg.warmup.lr,
                   batch=cfg.warmup.batch, seed=cfg.model.seed)
        after = evaluate(model, tokenizer, task, n=200)
        trainer = GRPOTrainer(model, grpo, version=0, pad_id=tokenizer.pad_token_id)
        log.info("warm-up: reward %.3f → %.3f in %.1f s", before["reward_mean"],
                 after["reward_mean"], time.perf_counter() - t0)
        emit({"event": "warmup", "before": before, "after": after, **w})
        trainer.save_checkpoint(cfg.state_dir / "ckpt-v0.pt")
        p = pub.publish(0, trainer.state_dict_bf16(), files)
        emit({"event": "publish", "version": 0, "snapshot_bytes": p.snapshot.payload_bytes,
              "dense_bytes": p.dense_bytes})
    else:
        if head not in ckpts:
            raise SystemExit(f"chain head is v{head} but {cfg.state_dir} has no ckpt-v{head}.pt; "
                             "restore the trainer state dir or start a new run")
        trainer.load_checkpoint(ckpts[head])
        pub.resume(trainer.state_dict_bf16())
        if head + 1 in ckpts:  # crashed after checkpointing v+1, before publishing it
            trainer.load_checkpoint(ckpts[head + 1])
            pub.publish(head + 1, trainer.state_dict_bf16(), files)
        log.info("resumed at v%d", trainer.version)
        emit({"event": "resume", "version": trainer.version})

    store = IngestStore(cfg.state_dir / "ingest")
    server = IngestThread(lambda: make_ingest_app(store, cfg.ingest.token, run=cfg.run),
                          cfg.ingest.host, cfg.ingest.port)
    server.start()
    log.info("ingest listening on http://%s:%d/v1/ingest", cfg.ingest.host, cfg.ingest.port)
    consumed = _read_consumed(cfg.state_dir, trainer.version)
    if consumed is not None and consumed > store.committed:  # crashed before the commit below
        server.call(store.take(consumed - store.committed, 0, min_n=0, whole_groups=False))
    try:
        while trainer.version < cfg.steps:
            batch = server.call(store.take(cfg.batch, cfg.wait_timeout_s, commit=False,
                                            min_n=cfg.batch))
            if not batch:
                raise SystemExit(f"no trajectories for {cfg.wait_timeout_s:.0f} s; are the "
                                 "rollout workers and daemons up? (see deltaswarm status)")
            m = trainer.step(batch)
            if not m["stepped"]:
                server.call(store.commit())
                emit({"event": "skip", **m})
                continue
            write_atomic(_consumed_path(cfg.state_dir, trainer.version), b"%d" % store.taken)
            trainer.save_checkpoint(cfg.state_dir / f"ckpt-v{trainer.version}.pt")
            p = pub.publish(trainer.version, trainer.state_dict_bf16(), files)
            _prune(cfg.state_dir)
            server.call(store.commit())
            rec = {"event": "step", **m, "delta_bytes": p.delta_bytes,
                   "delta_tensor_bytes": p.delta_tensor_bytes,
                   "delta_file_bytes": p.delta_file_bytes,
                   "dense_bytes": p.dense_bytes, "changed_elements": p.changed_elements,
                   "elements": p.elements, "publish_s": p.seconds,
                   "snapshot": p.snapshot is not None, "published_at": time.time()}
            emit(rec)
            log.info("v%d reward %.3f kept %d/%d staleness %s kl %.2e entropy %.3f %.0f tok/s "
                     "delta %.1f KiB tensors + %.1f KiB carried files (%.2f %% changed)",
                     trainer.version, m["reward_mean"], m["kept"], m["received"],
                     m["staleness_hist"], m["kl_behaviour"], m["entropy"], m["tokens_per_s"],
                     p.delta_tensor_bytes / 1024, p.delta_file_bytes / 1024, 100 * p.density)
        emit({"event": "done", "version": trainer.version})
        if cfg.on_exit == "serve":
            threading.Event().wait()
    finally:
        server.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deltaswarm train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, type=Path)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(message)s")
    from trainer.config import TrainerConfigError

    try:
        return run(a.config)
    except TrainerConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
