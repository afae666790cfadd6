"""`deltaswarm publish CKPT_DIR` and `deltaswarm watch DIR`: publish a trainer's HF checkpoint
directories through the trainer node's daemon, with no change to the trainer.

    deltaswarm publish ckpts/step_100 --config publish.yaml
    deltaswarm watch ckpts/ --config publish.yaml      # step_100/, step_200/, ... in order
    deltaswarm watch --config publish.yaml             # the config's watch.dir
    deltaswarm watch --config publish.yaml --status    # what was published, what was refused

publish.yaml (paths relative to the file):

    run: my-run                      # the daemons' run name
    chain_dir: /var/lib/deltaswarm/trainer/chain   # the trainer daemon's state_dir/chain
    key: /etc/deltaswarm/trainer.key
    state_dir: /var/lib/deltaswarm/publish         # head reconstruction + published.json
    daemon: {url: "http://127.0.0.1:7600", token_file: /etc/deltaswarm/token}
    watch: {pattern: '(?:step_|checkpoint-|global_step_)?(\\d+)', subdir: null, marker: null,
            extra_files: []}            # more files to carry than config + tokenizer (globs)

`watch` polls DIR every `poll_s`; a child whose name matches `pattern` (its group is the step)
is published, in step order, once it is whole (trainer.checkpoints.inspect_checkpoint) and no
file in it has changed for `settle_s`. A directory left incomplete and unchanged for
`abandon_s` (a trainer killed mid-save that went on from an older checkpoint) is skipped once a
later step is whole. A directory that can never be published as it stands (a symbolic link or
named pipe among its files, a file name or tensor header a manifest cannot carry; see
trainer.checkpoints) is refused once settled: the log says why, published.json's `refused`
list records it, and later steps go on; changing the directory makes it be judged again. A
directory that changes while it is published is not signed and is tried again at the next
scan. SIGTERM/SIGINT stop it at once, mid-publish too (nothing half-written is signed; a
restart publishes that step again); a restart resumes after the last published step
(state_dir/published.json).
"""

import argparse
import json
import logging
import re
import signal
import sys
import threading
import time
from pathlib import Path

from pydantic import Field, field_validator

from chain.config_base import NAME_PATTERN, ConfigError, Section, load_yaml, read_token
from chain.errors import ChainError
from trainer.config import GROUP_BELOW, DirectPositionsPct, GroupBelow

log = logging.getLogger("deltaswarm.watch")


class Stopped(BaseException):
    """SIGTERM/SIGINT reached `deltaswarm watch`: it leaves wherever it is (a BaseException, so
    no `except Exception` on the way keeps it)."""


class DaemonSection(Section):
    url: str | None = Field(None, pattern=r"^https?://\S+$", max_length=2048)
    """The trainer node's daemon control plane; null writes the chain dir only (the daemon
    picks the versions up when it starts)."""
    token_file: Path | None = None
    """File holding the swarm's bearer token on its first line (at least 8 characters): one
    secret shared by every daemon, publisher, ingest and worker of the swarm. `deltaswarm init`
    writes one; or `python -c 'import secrets; print(secrets.token_urlsafe(24))' > FILE`.
    Sent with POST /v1/publish."""

    def bearer(self) -> str | None:
        if self.token_file is None:
            return None
        return read_token(self.token_file, "daemon.token_file")


class WatchSection(Section):
    dir: Path | None = None
    """The directory the trainer writes checkpoints into (`deltaswarm watch DIR` overrides)."""
    pattern: str = Field(r"(?:step_|step-|checkpoint-|global_step_|global_step|iter_)?(\d+)",
                         max_length=512)
    """Regex a checkpoint directory's whole name matches; its first group is the step."""
    subdir: str | None = Field(None, max_length=512)
    """Path inside each step directory that holds the HF files (verl: `actor/huggingface`)."""
    marker: str | None = Field(None, pattern=r"^[A-Za-z0-9_.\-]{1,128}$")
    """A file the trainer writes last (e.g. `COMPLETE`); required when set."""
    settle_s: float = Field(2.0, ge=0, le=3600)
    """A checkpoint is published only when no file in it changed for this long."""
    poll_s: float = Field(2.0, gt=0, le=3600)
    """How often the directory is scanned."""
    abandon_s: float = Field(60.0, ge=0, le=7 * 86400)
    """An incomplete directory unchanged this long is skipped once a later step is whole."""
    extra_files: list[str] = Field([], max_length=64)
    """Glob patterns (fnmatch, case-sensitive, names only) of more files to carry with each
    version, beyond config.json, the tokenizer's files, generation_config.json and the chat
    template (trainer.checkpoints.CARRIED). Training state (optimizer*, *.pt, ...) never
    travels; a matching name a manifest cannot carry (a space, non-ASCII) refuses the
    checkpoint, naming the file."""

    @field_validator("extra_files")
    @classmethod
    def _names_only(cls, v: list[str]) -> list[str]:
        for pat in v:
            if not pat or len(pat) > 128 or "/" in pat or "\0" in pat:
                raise ValueError(f"{pat!r:.140}: a pattern matches file names in the checkpoint "
                                 "directory: 1-128 characters, no '/'")
        return v

    @field_validator("pattern")
    @classmethod
    def _one_group(cls, v: str) -> str:
        try:
            rx = re.compile(v)
        except re.error as e:
            raise ValueError(f"not a regular expression: {e}") from None
        if rx.groups < 1:
            raise ValueError("needs a group capturing the step number, like (\\d+)")
        return v


class PublishConfig(Section):
    run: str = Field(pattern=NAME_PATTERN)
    """Run name, stamped into every manifest; daemons refuse other runs."""
    chain_dir: Path
    """The chain directory the trainer node's daemon seeds (its state_dir/chain)."""
    key: Path
    """The trainer's Ed25519 signing key (deltaswarm keygen)."""
    state_dir: Path
    """Where the head reconstruction (two copies of the model) and published.json live."""
    daemon: DaemonSection = DaemonSection()
    """The local daemon told about each new version."""
    watch: WatchSection = WatchSection()
    """How `deltaswarm watch` finds and judges checkpoint directories."""
    snapshot_every: int = Field(10, ge=1, le=1_000_000)
    """Publish a full snapshot every this many versions (late joiners start from one)."""
    retention_versions: int = Field(16, ge=1, le=1_000_000)
    """Versions whose artifacts the chain directory keeps."""
    block_size: int = Field(4 << 20, ge=1 << 16, le=64 << 20)
    """Size of the content-addressed blocks a version's payload is cut into, in bytes."""
    direct_positions_pct: DirectPositionsPct = -1
    """How deltas code changed positions. -1 (default): the most compact. N >= 0: a segment
    is coded so a region decodes it reading only its changes where that costs at most N % more
    position bits (1000 at 1B: 0.55x the decode, 1.38x the bytes; see DirectPositionsPct).
    Upgrade every daemon first: older builds refuse such deltas."""
    group_below: GroupBelow = GROUP_BELOW
    """Tensors of fewer elements than this travel in group records: a run of small tensors
    (MoE experts) costs one record instead of one each. 0: a record per tensor, the only kind
    daemons from before group records read; set it while such regions remain."""
    base_chain: Path | None = None
    """A LoRA run: the chain directory its base model was published to. Checkpoints are then
    PEFT adapter directories (adapter_config.json + adapter_model.safetensors), each version
    pinned to that chain's head when publishing starts; full-model checkpoints are refused."""


def load_publish_config(path: str | Path) -> PublishConfig:
    return load_yaml(PublishConfig, path,
                     paths=("chain_dir", "key", "state_dir", "daemon.token_file",
                            "watch.dir", "base_chain"))


def make_publisher(cfg: PublishConfig):
    from chain.policy import Retention, SnapshotPolicy
    from trainer.checkpoints import CheckpointPublisher

    return CheckpointPublisher(cfg.chain_dir, cfg.key, cfg.run, cfg.state_dir, cfg.daemon.url,
                               cfg.daemon.bearer(), SnapshotPolicy(every=cfg.snapshot_every),
                               Retention(versions=cfg.retention_versions), cfg.block_size,
                               base=base_pin(cfg.base_chain) if cfg.base_chain else None,
                               direct_positions=cfg.direct_positions_pct,
                               group_below=cfg.group_below)


def base_pin(base_chain: Path):
    """The pin of the base chain's head version: what every adapter version applies to."""
    from chain.adapters import head_pin
    from chain.store import ChainStore

    pin = head_pin(ChainStore(base_chain))  # this host's own chain dir, read as written
    if pin is None:
        raise ConfigError(f"base_chain {base_chain} holds no version yet: publish the base model "
                          "first (trainer.lora.publish_base, or `deltaswarm publish` of the base "
                          "checkpoint into that chain)")
    return pin


class Watcher:
    """One scan at a time (`scan`), so a test or a caller drives it without threads."""

    def __init__(self, pub, root: Path, watch: WatchSection) -> None:
        self.pub, self.root, self.cfg = pub, Path(root), watch
        self.rx = re.compile(watch.pattern)
        self.seen: dict[Path, tuple[tuple, float]] = {}  # path -> (fingerprint, unchanged since)
        self.refused: dict[Path, tuple] = {}  # path -> its fingerprint when refused

    def candidates(self) -> list[tuple[int, Path]]:
        out = []
        for child in self.root.iterdir() if self.root.is_dir() else []:
            m = self.rx.fullmatch(child.name)
            if m and child.is_dir():
                out.append((int(m.group(1)), child / self.cfg.subdir if self.cfg.subdir
                            else child))
        return sorted(out)

    def _observe(self, path: Path, now: float) -> None:
        from trainer.checkpoints import _fingerprint

        fp = _fingerprint(path) if path.is_dir() else ()
        old = self.seen.get(path)
        if old is None or old[0] != fp:
            self.seen[path] = (fp, now)

    def _stale_for(self, path: Path, now: float) -> float:
        """How long nothing in `path` has changed: what this watcher saw, or the files' mtimes
        (so a torn directory from before a restart counts as stale at once)."""
        mtimes = [path.stat().st_mtime] if path.exists() else []
        mtimes += [p.lstat().st_mtime for p in path.iterdir()] if path.is_dir() else []
        return max(now - self.seen[path][1], time.time() - max(mtimes, default=time.time()))

    def scan(self, stop: threading.Event | None = None) -> list[int]:
        """Publish every whole, settled checkpoint after the last published step, in order;
        returns the steps published. A refused one is recorded and passed."""
        from trainer.checkpoints import Incomplete, Refused

        done: list[int] = []
        last = self.pub.last_step()
        now = time.monotonic()
        todo = [(s, p) for s, p in self.candidates() if last is None or s > last]
        for _, path in todo:
            self._observe(path, now)
        for step, path in todo:
            if stop is not None and stop.is_set():
                break
            fp, since = self.seen[path]
            if self.refused.get(path) == fp:
                continue  # refused as it stands; any change to it has it judged again
            try:
                ckpt = self._inspect(step, path)
            except Incomplete as e:
                stale = self._stale_for(path, now)
                if stale < self.cfg.abandon_s:
                    log.debug("step %d: %s", step, e)
                    break  # being written: later steps wait for it
                log.warning("step %d looks abandoned (%s, unchanged %.0f s); later steps may "
                            "pass it", step, e, stale)
                continue
            except Refused as e:
                if now - since < self.cfg.settle_s:
                    break  # may still be being written: judged once settled
                self._refuse(step, path, fp, str(e))
                continue
            if now - since < self.cfg.settle_s or ckpt.fingerprint != fp:
                break  # whole but still settling
            if self.pub.was_published(path) is not None:
                continue
            try:
                out = self.pub.publish(ckpt, step)
            except Refused as e:
                self._refuse(step, path, fp, str(e))
                continue
            except (ChainError, OSError):
                raise  # changed meanwhile, disk full, daemon chain damaged: retried next poll
            except Exception as e:  # a bug must not wedge the watcher on this step for ever
                log.exception("step %d: unexpected error while publishing", step)
                self._refuse(step, path, fp, f"unexpected error while publishing: {e!r:.500}")
                continue
            log.info("step %d -> v%d%s", step, out.version, "" if out.notified or
                     self.pub.daemon_url is None else " (daemon not told)")
            done.append(step)
        return done

    def _inspect(self, step: int, path: Path):
        """inspect_checkpoint, where a bug refuses this step rather than wedging the watcher."""
        from trainer.checkpoints import Refused, inspect_checkpoint

        try:
            return inspect_checkpoint(path, self.cfg.marker, tuple(self.cfg.extra_files))
        except (ChainError, OSError):
            raise
        except Exception as e:
            log.exception("step %d: unexpected error while inspecting it", step)
            raise Refused(f"unexpected error while inspecting it: {e!r:.500}") from None

    def _refuse(self, step: int, path: Path, fp: tuple, reason: str) -> None:
        self.refused[path] = fp
        log.error("step %d refused, later steps go on: %s", step, reason)
        self.pub.record_refused(path, step, reason)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.scan(stop)
            except (ChainError, OSError) as e:  # e.g. a step directory deleted mid-scan
                log.error("%s (retrying in %.0f s)", e, self.cfg.poll_s)
            stop.wait(self.cfg.poll_s)


RETRIES = 3
"""How often `deltaswarm publish` reads a checkpoint that changed while it was published."""


def _publish_retrying(pub, ckpt_dir: Path, cfg: PublishConfig, step: int | None):
    from trainer.checkpoints import Changed, settled

    for attempt in range(1, RETRIES + 1):
        try:
            return pub.publish(settled(ckpt_dir, cfg.watch.settle_s, cfg.watch.marker,
                                       tuple(cfg.watch.extra_files)), step)
        except Changed as e:
            if attempt == RETRIES:
                raise Changed(f"{e} ({RETRIES} attempts; is the trainer still writing it?)"
                              ) from None
            print(f"warning: {e}; reading it again ({attempt}/{RETRIES})", file=sys.stderr)
    raise AssertionError("unreachable")


def main_publish(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deltaswarm publish",
                                description="publish one HF checkpoint directory as the next "
                                "version (see `deltaswarm watch` for a directory of them)")
    p.add_argument("ckpt_dir", type=Path)
    p.add_argument("--config", required=True, type=Path)
    p.add_argument("--step", type=int, default=None, help="the trainer step (recorded only)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s publish %(message)s")
    try:
        cfg = load_publish_config(a.config)
        pub = make_publisher(cfg)
        out = _publish_retrying(pub, a.ckpt_dir, cfg, a.step)
    except (ConfigError, ChainError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"published {a.ckpt_dir} as v{out.version}"
          + ("" if out.notified else " (daemon not told; it seeds it when it starts)"))
    return 0


def print_status(cfg: PublishConfig) -> int:
    """`deltaswarm watch --status`: the last published steps and every refused directory with
    its reason, from state_dir/published.json (read only; nothing is started)."""
    path = cfg.state_dir / "published.json"
    try:
        doc = json.loads(path.read_text()) if path.exists() else {}
        published, refused = list(doc.get("published", [])), list(doc.get("refused", []))
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise ChainError(f"{path} is damaged ({e})") from None
    print(f"published: {len(published)} checkpoint(s)"
          + (f", last step {published[-1]['step']} as v{published[-1]['version']}"
             if published else ""))
    for p in published[-5:]:
        print(f"  step {p['step']} -> v{p['version']}  {p['dir']}")
    print(f"refused: {len(refused)}")
    for r in refused:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.get("at", 0)))
        print(f"  step {r.get('step')} at {when} UTC  {r.get('dir')}\n    {r.get('reason')}")
    return 0


def main_watch(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deltaswarm watch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, nargs="?", help="default: the config's watch.dir")
    p.add_argument("--config", required=True, type=Path)
    p.add_argument("--once", action="store_true", help="scan once and exit")
    p.add_argument("--status", action="store_true",
                   help="print what was published and what was refused (and why), and exit")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s watch %(message)s")
    try:
        cfg = load_publish_config(a.config)
        if a.status:
            return print_status(cfg)
        root = a.dir or cfg.watch.dir
        if root is None:
            raise ConfigError(f"config {a.config}: give the directory to watch, as DIR or as "
                              "watch.dir")
        watcher = Watcher(make_publisher(cfg), root, cfg.watch)
    except (ConfigError, ChainError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        if not stop.is_set():  # the first one leaves; a second one during the exit is ignored
            stop.set()
            raise Stopped(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        if a.once:  # two scans a settle time apart: a checkpoint must be seen unchanged
            watcher.scan()
            time.sleep(cfg.watch.settle_s)
            watcher.scan()
            return 0
        log.info("watching %s (run %s, resuming after step %s)", root, cfg.run,
                 watcher.pub.last_step())
        watcher.run(stop)
    except Stopped as e:
        log.info("stopped by %s", e)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry for `python -m trainer.ckpt_cli publish|watch ...`."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["publish"]:
        return main_publish(argv[1:])
    if argv[:1] == ["watch"]:
        return main_watch(argv[1:])
    print("usage: python -m trainer.ckpt_cli publish|watch ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
