"""Per-tensor and per-rank costs at scale (issue 21): what a version costs when the same bytes
come in 50,000 tensors instead of ~200, what the record framing adds to a delta, and what
sharded publishing costs against the single-process Publisher. One JSON line last with --json.

    python bench/scaleout.py [--json] [--elements 5e7] [--moe-tensors 50000] [--ranks]
                             [--per-tensor 100000,1572864]

- `tensors_moe`, `moe_publish_over_dense`, `moe_apply_over_dense`: a bf16 model of `--elements`
  elements, once as ~200 tensors (Llama-like rows) and once as `--moe-tensors` tensors (expert
  matrices of the same total), the same ~1 % of elements changed per version by the same kind
  of step. Publisher.publish of each delta and WeightsDir.apply of it (the region's journaled,
  digest-checked pass), median of `--versions` deltas (5: the first delta after the snapshot
  runs a cold path on both sides, a fresh directory built and every tensor viewed for the
  first time, its apply 1.7-3x a steady one and its publish up to 1.7x; it still counts
  among the 5 but no longer decides the median, where of 3 the median was the slower of the
  two steady ones), best of `--rounds` for each side (unpaired: each side's luckiest round),
  sides interleaved so load from other work favours neither.
- `moe_publish_over_dense_paired`, `moe_apply_over_dense_paired`: the same ratios taken
  within each round (moe over the dense run beside it), median over rounds: this host's speed
  drifts 15-30 % between runs, and best-of figures can pair one side's lucky run with the
  other's unlucky one.
- `moe_first_delta_publish_over_dense`, `moe_first_delta_apply_over_dense`: that first delta
  alone, the same two ratios (what a region pays once, when it starts from a snapshot).
- `moe_read_floor_s`, `moe_publish_floor_over_dense`: reading the 50,000-tensor state dict's
  dtypes and shapes once (what any publisher does a tensor before any coding), and
  (dense publish + that) / dense publish: a lower bound of `moe_publish_over_dense` for any
  publisher handed torch tensors, measured in the same run.
- `moe_by_tensor_elements` (with `--per-tensor 100000,1572864`): the same two ratios with the
  same bytes cut into tensors of each given size instead (1,572,864 = 768 x 2048, a
  Qwen3-30B-A3B expert matrix), against the same dense runs. At equal bytes a per-tensor cost
  adds (tensors x its cost) / (bytes x cost a byte), so the ratio follows the elements a tensor
  holds, not the count: `--elements 1e9` at 50,000 tensors is 20,000 elements a tensor, 80x
  smaller than any expert of a real 18,000-69,000-tensor MoE checkpoint, which this host cannot
  hold 50,000 of.
- `delta_file_over_payload`: a 101-tensor Llama-shaped model's 1 %-dense delta as it travels
  (the artifact's block bytes) over the codec payloads its records carry.
- `sharded_1rank_over_publisher`, `ranks2_over_ranks1` (with --ranks): bench/scale.py --ranks 2
  at `--params` (1B by default, minutes), which runs Publisher, one rank and two ranks on the
  same versions.
- `ns`, `trainer_control_bytes_per_version`, `trainer_cpu_s_per_version`, `all_current`
  (`--nodes 8,16,32`): real daemons on loopback, a trainer in a region of its own and N nodes in
  regions of `--region-size`; per delta version, the trainer daemon's HTTP response body bytes
  (its per-route counters, daemon/observe/served.py; median of `--fleet-versions`) and CPU
  seconds (the process's CPU clock; the mean over the versions) over a version's period
  (`--fleet-period`, PERIOD_S: one version every 6 s at every N, each reaching every node
  within it), not counting the bench's own /metrics scrapes between versions (their CPU is
  `trainer_scrape_cpu_s`, one scrape's mean);
  `control_*_last_over_first` divide the largest N's
  by the smallest's (goal: at most 1.5, flat in N). Also per N: `version_window_s` (publish to
  every node current; before stop 53 it included the 1 s settle),
  `trainer_cpu_s_to_current` (the trainer's CPU from publish until a second after every node
  is current: this bench's figure before stop 53, which grows with that window on this 2-core
  host; `control_cpu_to_current_last_over_first`),
  `trainer_idle_cpu_s_per_s` (the trainer's CPU rate over 10 s with no version moving: its
  once-a-second loops, reports, long-polls) and `trainer_cpu_s_per_version_over_idle` (the
  mean CPU per version less that rate times the period; `control_cpu_over_idle_
  last_over_first` divides those), `period_overruns` (versions whose publish, reach to every
  node and 1 s settle outlasted the period: their CPU is counted until then, the idle rate
  taken out of the over-idle figure for one period only). `fetchers_per_region`,
  `fleet_fetchers`, `gateway_views`: what each node's status says of fetch roles and gateways
  after the versions (right: 1 per region, 1, 1); `--max-peers 4` makes every book far smaller
  than the fleet.
  The versions are measured once the fleet has started: until a node knows its region's peers
  it long-polls the trainer (its one bootstrap peer), and those held polls end when their
  timeout runs out, inside whichever window is open then (at N = 32, 32 head replies landed in
  the first version's). What the start costs the trainer is printed apart:
  `trainer_start_head_responses` and `trainer_start_cpu_s`, from v0's publish until a second
  past the daemons' long-poll timeout after every node holds it.
"""

import argparse
import contextlib
import ctypes
import ctypes.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chain import keys  # noqa: E402
from chain.policy import SnapshotPolicy  # noqa: E402
from chain.sources import StateDictSource  # noqa: E402
from chain.store import ChainStore  # noqa: E402
from chain.stream import BlockReader  # noqa: E402
from chain.weights import WeightsDir  # noqa: E402
from trainer.publisher import Publisher  # noqa: E402

GOALS = {"control_bytes_last_over_first": 1.5, "control_cpu_last_over_first": 1.5,
         "moe_publish_over_dense": 1.25, "moe_apply_over_dense": 1.25,
         "sharded_1rank_over_publisher": 1.2, "ranks2_over_ranks1": 1.0,
         "delta_file_over_payload": 1.03}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def dense_shapes(elements: int, tensors: int = 200) -> dict[str, list[int]]:
    """~`tensors` Llama-like matrices (and norms) holding about `elements` elements."""
    layers = max(1, -(-(tensors - 3) // 9))
    hidden = 64
    while llama_elements(hidden * 2, layers) <= elements:
        hidden *= 2
    lo, hi = hidden, hidden * 2
    while hi - lo > 8:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if llama_elements(mid, layers) <= elements else (lo, mid)
    return llama(lo // 8 * 8, layers)


def llama(hidden: int, layers: int) -> dict[str, list[int]]:
    ff, kv = hidden * 11 // 4, hidden // 4
    out = {"model.embed_tokens.weight": [4 * hidden, hidden], "model.norm.weight": [hidden],
           "lm_head.weight": [4 * hidden, hidden]}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": [hidden, hidden],
                p + "self_attn.k_proj.weight": [kv, hidden],
                p + "self_attn.v_proj.weight": [kv, hidden],
                p + "self_attn.o_proj.weight": [hidden, hidden],
                p + "mlp.gate_proj.weight": [ff, hidden], p + "mlp.up_proj.weight": [ff, hidden],
                p + "mlp.down_proj.weight": [hidden, ff],
                p + "input_layernorm.weight": [hidden],
                p + "post_attention_layernorm.weight": [hidden]}
    return out


def llama_elements(hidden: int, layers: int) -> int:
    return sum(int(np.prod(s)) for s in llama(hidden, layers).values())


def moe_shapes(elements: int, tensors: int) -> dict[str, list[int]]:
    """`tensors` expert matrices (gate, up, down of 48 layers' experts) of `elements` in all."""
    per = max(1, elements // tensors)
    cols = 64
    rows = max(1, per // cols)
    out = {}
    experts = -(-tensors // (48 * 3))
    for i in range(tensors):
        layer, rest = divmod(i, experts * 3)
        e, kind = divmod(rest, 3)
        out[f"model.layers.{layer}.mlp.experts.{e}.{('gate', 'up', 'down')[kind]}_proj.weight"] \
            = [rows, cols]
    return out


def versions(shapes: dict[str, list[int]], count: int, density: float, seed: int
             ) -> Iterator[dict[str, torch.Tensor]]:
    """v0 random bf16, then each version flips about `density` of every tensor's elements by
    one or two bf16 steps (what an Adam step at RL learning rates does to bf16 weights). Made
    one at a time (the same ones for the same seed), so a model of several GB fits twice."""
    rng = np.random.default_rng(seed)
    state = {k: torch.from_numpy(rng.standard_normal(int(np.prod(s)), np.float32)
                                 .reshape(s)).bfloat16() for k, s in shapes.items()}
    yield state
    for _ in range(count):
        nxt = {}
        for k, t in state.items():
            bits = t.view(torch.int16).numpy().reshape(-1).copy()
            k_changed = max(1, round(bits.size * density))
            idx = rng.choice(bits.size, k_changed, replace=False)
            bits[idx] += rng.choice(np.array([1, -1, 2], np.int16), k_changed)
            nxt[k] = torch.from_numpy(bits.reshape(t.shape)).view(torch.bfloat16)
        state = nxt
        yield state


def publish_and_apply(work: Path, states: Iterable[dict[str, torch.Tensor]]
                      ) -> tuple[list[float], list[float], list]:
    """Seconds of each delta's publish and apply; the manifests."""
    key = work / "trainer.key"
    if not key.exists():
        keys.generate(key)
    pub = Publisher(chain_dir=work / "chain", key_path=key, run="scaleout",
                    snapshots=SnapshotPolicy(every=10**6, max_delta_ratio=1e9))
    store = ChainStore(work / "chain")
    weights = WeightsDir(work / "weights")
    pubs, applies, manifests = [], [], []
    for v, state in enumerate(states):
        t0 = time.perf_counter()
        out = pub.publish(v, state)
        t1 = time.perf_counter()
        m = out.delta or out.snapshot
        cur = weights.apply([m], lambda b: store.blocks.get(b.id, b.size))
        t2 = time.perf_counter()
        if cur.state_digest != m.state_digest:
            raise SystemExit(f"v{v}: the applied state differs from the published one")
        if v:
            pubs.append(t1 - t0)
            applies.append(t2 - t1)
            manifests.append(m)
    return pubs, applies, manifests


def tensor_count_costs(elements: int, moe_tensors: int, n_versions: int, rounds: int,
                       per_tensor: list[int]) -> dict:
    sides = {"dense": dense_shapes(elements), "moe": moe_shapes(elements, moe_tensors)}
    for name, shapes in sides.items():
        log(f"{name}: {len(shapes)} tensors, {sum(int(np.prod(x)) for x in shapes.values()):,} "
            "elements")
    best: dict[str, dict[str, float]] = {}
    rounds_seen: list[dict[str, tuple[float, float]]] = []  # each round's (publish, apply)
    for r in range(rounds):
        rounds_seen.append({})
        for name in ("dense", "moe") if r % 2 == 0 else ("moe", "dense"):
            with tempfile.TemporaryDirectory(prefix="scaleout-", dir=_tmp_root()) as tmp:
                pubs, applies, _ = publish_and_apply(
                    Path(tmp), versions(sides[name], n_versions, 0.01, seed=7))
            p, a = statistics.median(pubs), statistics.median(applies)
            rounds_seen[-1][name] = (p, a)
            log(f"round {r + 1} {name}: publish {p:.3f} s, apply {a:.3f} s per delta (the "
                f"first: {pubs[0]:.3f} s, {applies[0]:.3f} s)")
            b = best.setdefault(name, {})
            for k, v in (("publish", p), ("apply", a), ("first_publish", pubs[0]),
                         ("first_apply", applies[0])):
                b[k] = min(b.get(k, v), v)
    sweep = {}
    for per in per_tensor:
        count = max(1, elements // per)
        with tempfile.TemporaryDirectory(prefix="scaleout-", dir=_tmp_root()) as tmp:
            pubs, applies, _ = publish_and_apply(
                Path(tmp), versions(moe_shapes(elements, count), n_versions, 0.01, seed=7))
        p, a = statistics.median(pubs), statistics.median(applies)
        log(f"{count} tensors of {per:,} elements: publish {p:.3f} s, apply {a:.3f} s per delta")
        sweep[str(per)] = {"tensors": count,
                           "publish_over_dense": round(p / best["dense"]["publish"], 3),
                           "apply_over_dense": round(a / best["dense"]["apply"], 3)}
    floor = read_floor_s(sides["moe"])
    log(f"reading the {len(sides['moe'])} tensors' dtype and shape once: {floor:.3f} s")
    return {"tensors_moe": len(sides["moe"]), "tensors_dense": len(sides["dense"]),
            "elements": elements, "seconds": best,
            "moe_publish_over_dense": round(best["moe"]["publish"] / best["dense"]["publish"], 3),
            "moe_apply_over_dense": round(best["moe"]["apply"] / best["dense"]["apply"], 3),
            **{f"moe_first_delta_{k}_over_dense": round(best["moe"][f"first_{k}"]
                                                         / best["dense"][f"first_{k}"], 3)
               for k in ("publish", "apply")},
            # the same ratios paired: each round's moe over that round's dense (run next to
            # each other), the median over rounds; less moved by the host's drift than
            # best-of figures, which may pair a lucky run with an unlucky one
            **{f"moe_{k}_over_dense_paired": round(statistics.median(
                seen["moe"][i] / seen["dense"][i] for seen in rounds_seen), 3)
               for i, k in enumerate(("publish", "apply"))},
            "moe_read_floor_s": round(floor, 3),
            **({"moe_by_tensor_elements": sweep} if sweep else {}),
            "moe_publish_floor_over_dense": round(
                (best["dense"]["publish"] + floor) / best["dense"]["publish"], 3)}


def read_floor_s(shapes: dict[str, list[int]], repeats: int = 3) -> float:
    """Seconds to read every tensor of a state dict of `shapes` once the way any publisher
    must: its dtype and shape, to see what changed layout (the writer reads a group's data
    from torch in one call, StateDictSource.cat, so a bit view a tensor is no longer one of
    its per-tensor steps), best of `repeats`. Any publish of that state dict costs at least
    the dense publish of the same bytes plus this, so (dense + this) / dense bounds
    `moe_publish_over_dense` from below for a publisher handed torch tensors."""
    state = next(versions(shapes, 0, 0.01, seed=7))
    best = float("inf")
    for _ in range(repeats):
        src = StateDictSource(state)
        t0 = time.perf_counter()
        for name in src.names():
            src.meta(name)
        best = min(best, time.perf_counter() - t0)
    return best


def framing(elements: int) -> dict:
    shapes = dict(list(dense_shapes(elements, tensors=101).items())[:101])
    states = versions(shapes, 1, 0.01, seed=11)
    with tempfile.TemporaryDirectory(prefix="scaleout-", dir=_tmp_root()) as tmp:
        _, _, [m] = publish_and_apply(Path(tmp), states)
        store = ChainStore(Path(tmp) / "chain")
        reader = BlockReader.of_blocks(m.blocks, lambda b: store.blocks.get(b.id, b.size))
        payload = records = 0
        while (h := reader.next_header()) is not None:
            reader.skip(h.n)
            payload, records = payload + h.n, records + 1
    travelled = sum(b.size for b in m.blocks)
    log(f"framing: {len(shapes)} tensors, {records} records, {travelled:,} bytes in blocks, "
        f"{payload:,} of codec payload")
    return {"tensors": len(shapes), "records": records, "block_bytes": travelled,
            "payload_bytes": payload,
            "delta_file_over_payload": round(travelled / payload, 4)}


def ranks(params: float) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "scale.py"), "--ranks", "2", "--params",
           str(params), "--json"]
    log("running " + " ".join(cmd[1:]))
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    doc = json.loads(out.strip().splitlines()[-1])
    return {k: doc.get(k) for k in ("sharded_1rank_over_publisher", "ranks2_over_ranks1",
                                    "mem_over_shard")}


NOT_CONTROL = ("/metrics", "/v1/publish")
"""Routes not counted as the control plane: this bench's own scrapes, the trainer's publisher."""
HEAD = "/v1/chain/head"


IDLE_S = 10.0
"""How long the trainer's idle CPU rate is sampled after the versions."""
PERIOD_S = 6.0
"""Seconds between the bench's versions, the same at every N: longer than a version takes to
reach all 32 nodes here plus a 1 s settle (1.3-3.6 s to every node). A trainer publishes on
its own clock (an RL step, a minute or more), and its daemon's loops, reports and glances run
the whole time, so its CPU per version is its CPU over a period. Charging each version from
its publish until every node held it (`trainer_cpu_s_to_current`) grew with N partly because
that window did (33 daemons on two cores), with the trainer's idle rate running through it."""


_LIBC_PATH = ctypes.util.find_library("c")
_LIBC = ctypes.CDLL(_LIBC_PATH) if _LIBC_PATH else None


def _cpu_s(pid: int) -> float:
    """A process's CPU seconds so far, all its threads: its CPU-time clock (nanoseconds,
    clock_getcpuclockid), else /proc's user + system in 10 ms ticks. A version costs the
    trainer 10-50 ms, so a tick could be as much as a version's whole figure."""
    clock = ctypes.c_int()
    if _LIBC is not None and _LIBC.clock_getcpuclockid(pid, ctypes.byref(clock)) == 0:
        with contextlib.suppress(OSError):
            return time.clock_gettime(clock.value)
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _trainer_sent(trainer) -> tuple[float, float, dict[str, float], dict[str, float]]:
    """(the trainer daemon's CPU seconds before and after this bench's own /metrics scrape,
    its response body bytes per route, its responses per route). A window measured from one
    call's `after` to the next call's `before` holds none of the bench's scrapes: a scrape
    per version is the bench's own work (8-10 ms of the trainer's CPU here, a quarter of a
    version at N = 8), where a Prometheus scrape runs on a clock."""
    from daemon.observe.served import route_counts
    from tests.integration.harness import http

    before = _cpu_s(trainer.proc.pid)
    _, raw, _ = http(f"{trainer.url}/metrics")
    after = _cpu_s(trainer.proc.pid)
    text = raw.decode()
    return (before, after, route_counts(text, "deltaswarm_http_response_bytes"),
            route_counts(text, "deltaswarm_http_responses"))


def fleet_costs(ns: list[int], region_size: int, n_versions: int,
                max_peers: int | None = None, period_s: float = PERIOD_S) -> dict:
    """Real daemons on loopback (tests/integration/harness.py): a trainer in a region of its
    own and N region daemons in regions of `region_size`; a small model published as v0 then
    `n_versions` deltas, one every `period_s`; per delta, the trainer daemon's HTTP response
    bytes and CPU seconds over its period, and its CPU from publish until every node holds it
    plus a second."""
    from tests.integration.harness import Cluster, step, tiny_model

    out: dict = {"ns": ns, "region_size": region_size, "trainer_control_bytes_per_version": [],
                 "trainer_cpu_s_per_version": [], "trainer_bytes_by_route": [],
                 "trainer_responses_by_route": [], "version_windows_s": [],
                 "trainer_cpu_s_each_version": [], "trainer_scrape_cpu_s": [],
                 "version_window_s": [], "trainer_idle_cpu_s_per_s": [],
                 "trainer_cpu_s_per_version_over_idle": [], "max_peers": max_peers,
                 "fetchers_per_region": [], "fleet_fetchers": [], "gateway_views": [],
                 "trainer_start_head_responses": [], "trainer_start_cpu_s": [],
                 "trainer_cpu_s_to_current": [], "period_s": period_s, "period_overruns": [],
                 "all_current": True}
    for n in ns:
        with tempfile.TemporaryDirectory(prefix="scaleout-fleet-", dir=_tmp_root()) as tmp, \
                Cluster(Path(tmp)) as c:
            trainer = c.trainer(region="tr")
            for i in range(n):
                c.region(f"n{i}", region=f"r{i // region_size}",
                         sync={"progress_timeout_s": 120},
                         **({} if max_peers is None else {"max_peers": max_peers}))
            t0 = time.monotonic()
            c.start_all(timeout=300)
            log(f"N={n}: {n} daemons up in {time.monotonic() - t0:.0f} s")
            state = tiny_model(0, tensors=8, rows=256, cols=512)
            _, start_cpu, _, start_asked = _trainer_sent(trainer)
            c.publish(0, state, snapshot=True)
            c.wait_all_at(0, 300)
            settle_s = max(d.config["long_poll_timeout_s"] for d in c.daemons.values()) + 1.0
            time.sleep(settle_s)  # the start's held polls have ended
            start_cpu1, _, _, start_asked1 = _trainer_sent(trainer)
            out["trainer_start_head_responses"].append(round(
                start_asked1.get(HEAD, 0.0) - start_asked.get(HEAD, 0.0)))
            out["trainer_start_cpu_s"].append(round(start_cpu1 - start_cpu, 3))
            per_bytes, per_cpu, per_s, routes, calls, scrapes = [], [], [], {}, {}, []
            to_current, overruns = [], 0
            for v in range(1, n_versions + 1):
                _, cpu0, sent0, asked0 = _trainer_sent(trainer)
                t0 = time.monotonic()
                state = step(state, v, density=0.01)
                c.publish(v, state)
                c.wait_all_at(v, 300)
                reached = time.monotonic() - t0
                time.sleep(1.0)  # the last replies of this version (index re-reads) land
                to_current.append(_cpu_s(trainer.proc.pid) - cpu0)
                # then the rest of the period: a run publishes on its trainer's clock, and
                # the fleet's size must not stretch what a version is charged for
                rest = period_s - (time.monotonic() - t0)
                overruns += rest < 0
                time.sleep(max(0.0, rest))
                cpu1, scraped, sent1, asked1 = _trainer_sent(trainer)
                scrapes.append(scraped - cpu1)
                per_s.append(reached)
                per_bytes.append(sum(sent1[r] - sent0.get(r, 0.0) for r in sent1
                                     if r not in NOT_CONTROL))
                per_cpu.append(cpu1 - cpu0)
                for r in sent1:
                    routes.setdefault(r, []).append(sent1[r] - sent0.get(r, 0.0))
                for r in asked1:
                    calls.setdefault(r, []).append(asked1[r] - asked0.get(r, 0.0))
            # the trainer's CPU with no version moving (its once-a-second loops, the fleet's
            # reports and long-polls), per second: a version's window on a host this loaded
            # grows with N (33 daemons on 2 cores), and so would this rate times the window
            cpu0 = _trainer_sent(trainer)[1]
            time.sleep(IDLE_S)
            idle = (_trainer_sent(trainer)[0] - cpu0) / IDLE_S
            digest = trainer.status()["state_digest"]
            current = all(d.status()["state_digest"] == digest
                          for d in c.daemons.values() if d.role == "region")
            out["all_current"] = out["all_current"] and current
            # CPU: the mean over the versions (kept from when /proc's 10 ms ticks rounded
            # each version's figure: medians of 0.02 and 0.05 s moved a ratio by 2x)
            b, cpu = statistics.median(per_bytes), sum(per_cpu) / len(per_cpu)
            window = statistics.median(per_s)
            net = cpu - idle * period_s
            roles = _roles(c)
            out["trainer_control_bytes_per_version"].append(round(b))
            out["trainer_cpu_s_per_version"].append(round(cpu, 4))
            out["trainer_cpu_s_to_current"].append(round(sum(to_current) / len(to_current), 4))
            out["period_overruns"].append(overruns)
            out["version_window_s"].append(round(window, 2))
            out["trainer_idle_cpu_s_per_s"].append(round(idle, 4))
            out["trainer_cpu_s_per_version_over_idle"].append(round(net, 3))
            out["trainer_bytes_by_route"].append(
                {r: round(statistics.median(x)) for r, x in sorted(routes.items()) if any(x)})
            out["trainer_responses_by_route"].append(
                {r: round(sum(x) / len(x), 1) for r, x in sorted(calls.items()) if any(x)})
            out["version_windows_s"].append([round(x, 2) for x in per_s])
            out["trainer_cpu_s_each_version"].append([round(x, 4) for x in per_cpu])
            out["trainer_scrape_cpu_s"].append(round(sum(scrapes) / len(scrapes), 4))
            out["fetchers_per_region"].append(roles["fetchers_per_region"])
            out["fleet_fetchers"].append(roles["fleet_fetchers"])
            out["gateway_views"].append(roles["gateway_views"])
            log(f"N={n}: trainer sent {b:,.0f} B (median of {n_versions}) and used {cpu:.3f} "
                f"CPU s per version (mean, a version every {period_s:.0f} s, {overruns} late; "
                f"{out['trainer_cpu_s_to_current'][-1]:.3f} s from publish until all current "
                f"+ 1 s, median {window:.1f} s to current; the trainer's idle CPU {idle:.4f} "
                f"s/s, above idle {net:.3f} s); all current: {current}; "
                f"fetchers per region {roles['fetchers_per_region']}, fleet fetchers "
                f"{roles['fleet_fetchers']}, distinct views of the gateways "
                f"{roles['gateway_views']}; the fleet's start (v0 and {settle_s:.0f} s): "
                f"{out['trainer_start_head_responses'][-1]} head replies, "
                f"{out['trainer_start_cpu_s'][-1]:.3f} CPU s")
    for ratio, series in (("control_bytes", "trainer_control_bytes_per_version"),
                          ("control_cpu", "trainer_cpu_s_per_version"),
                          ("control_cpu_over_idle", "trainer_cpu_s_per_version_over_idle"),
                          ("control_cpu_to_current", "trainer_cpu_s_to_current")):
        first, last = out[series][0], out[series][-1]
        out[f"{ratio}_last_over_first"] = round(last / first, 3) if first > 0 else None
    return out


def _roles(c) -> dict:
    """What every region daemon's status says of fetch roles and gateways (daemon/peering/
    regions.py): how many nodes of each region fetch for it ("region", or "fleet" for the one
    that asks the trainer), how many believe they fetch for the fleet, and how many distinct
    views of the elected gateways there are. Computed from each node's own peer book: with
    `--max-peers` well under N these hold only if every book keeps each region's first-ranked
    members (docs/SCALE.md 7.5); the right answer is 1 per region, 1 fleet fetcher."""
    per_region: dict[str, int] = {}
    fleet, views = 0, set()
    for d in c.daemons.values():
        if d.role != "region":
            continue
        rp = d.status().get("region_peering", {})
        region = rp.get("region")
        per_region.setdefault(region, 0)
        if rp.get("fetch_role") in ("region", "fleet"):
            per_region[region] += 1
        fleet += rp.get("fetch_role") == "fleet"
        views.add(json.dumps(rp.get("gateways"), sort_keys=True))
    return {"fetchers_per_region": [per_region[r] for r in sorted(per_region, key=str)],
            "fleet_fetchers": fleet, "gateway_views": len(views)}


def _tmp_root() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize \
        > 4 << 30 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--elements", type=float, default=5e7)
    ap.add_argument("--moe-tensors", type=int, default=50_000)
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--per-tensor", default="",
                    help="also the ratios with --elements cut into tensors of these sizes")
    ap.add_argument("--ranks", action="store_true", help="also run bench/scale.py --ranks 2")
    ap.add_argument("--params", type=float, default=1e9)
    ap.add_argument("--nodes", default="8,16,32",
                    help="fleet sizes to run (real daemons on loopback); empty: skip")
    ap.add_argument("--region-size", type=int, default=8)
    ap.add_argument("--fleet-versions", type=int, default=5)
    ap.add_argument("--fleet-period", type=float, default=PERIOD_S,
                    help="seconds between the fleet's versions (the same at every N)")
    ap.add_argument("--max-peers", type=int, default=None,
                    help="each region daemon's peer book size (default: the daemon's, 32); "
                         "under N, the views must agree through anchors")
    ap.add_argument("--skip-tensors", action="store_true")
    a = ap.parse_args()
    log(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
    result: dict = {"load_avg_1m": round(os.getloadavg()[0], 2)}
    result |= framing(int(4e7))
    if not a.skip_tensors:
        result |= tensor_count_costs(int(a.elements), a.moe_tensors, a.versions, a.rounds,
                                     [int(float(x)) for x in a.per_tensor.split(",") if x])
    if a.ranks:
        result |= ranks(a.params)
    if a.nodes:
        result |= fleet_costs([int(x) for x in a.nodes.split(",")], a.region_size,
                              a.fleet_versions, a.max_peers, a.fleet_period)
    for k, goal in GOALS.items():
        if result.get(k) is not None:
            log(f"{k}: {result[k]} (goal <= {goal}: {'PASS' if result[k] <= goal else 'MISS'})")
    if a.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
