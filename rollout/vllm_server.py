"""Client for a stock `vllm serve` in dev mode: hot-reload a verified version, and generate.

`VllmServerHook.reload(path, version)` is what the daemon's `type: vllm` engine hook calls once
a version's HF directory is complete and verified: pause (keep requests) -> reload weights
(whole directory, or only the changed modules through the deltaswarm worker extension) ->
reset the prefix cache (its KV came from the old weights) -> set the weight version -> resume.
`generate` tags every completion with the weight version vLLM itself reports for its tokens.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from rollout.engine import Completion


class VllmServerError(RuntimeError):
    """vLLM answered an error (status and body in the message) or could not be reached."""


class VllmPatchUnsupported(VllmServerError):
    """This vLLM keeps weights in kernel layout (its CPU backend does), so elements cannot be
    patched in place; nothing was paused or changed. Use reload(..., changed=names) instead."""


class VllmReloadError(VllmServerError):
    """A reload failed after the pause; the engine is left paused so it never serves weights
    that are neither version. A later successful reload resumes it."""


@dataclass
class ReloadReport:
    version: int
    path: str
    mode: str
    seconds: dict[str, float] = field(default_factory=dict)
    worker: list[Any] = field(default_factory=list)


def version_of(label: str) -> int | None:
    try:
        return int(label)
    except ValueError:
        return None


class VllmServerHook:
    """Talks to one vLLM server. `scale_out=True` needs `vllm serve --enable-scale-out` (the
    launcher's default): generation goes through /inference/v1/generate, whose responses carry
    weight-version spans; otherwise /v1/completions, bracketed by /weight_info reads."""

    def __init__(self, base_url: str, *, model: str = "deltaswarm", scale_out: bool = True,
                 pause_mode: str = "keep", timeout_s: float = 300.0) -> None:
        if pause_mode not in ("keep", "wait", "abort"):
            raise ValueError(f"pause_mode must be keep, wait or abort, not {pause_mode!r}")
        self.base_url = base_url.rstrip("/")
        self.model, self.scale_out, self.pause_mode = model, scale_out, pause_mode
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def _call(self, method: str, route: str, *, params: dict[str, str] | None = None,
                    json: Any = None) -> Any:
        try:
            async with aiohttp.ClientSession(timeout=self.timeout) as s, s.request(
                method, self.base_url + route, params=params, json=json
            ) as r:
                body = await r.read()
                if r.status != 200:
                    raise VllmServerError(f"{method} {route} -> HTTP {r.status}: "
                                          f"{body[:500].decode(errors='replace')}")
                return await r.json() if body and r.content_type == "application/json" else None
        except aiohttp.ClientError as exc:
            raise VllmServerError(f"{method} {route}: {exc!r}") from exc

    async def rpc(self, method: str, **kwargs: Any) -> list[Any]:
        """Call a worker method on every worker (POST /collective_rpc); one result per worker."""
        out = await self._call("POST", "/collective_rpc", json={"method": method, "kwargs": kwargs})
        return (out or {}).get("results", [])

    async def weight_version(self) -> str:
        return (await self._call("GET", "/weight_info"))["weight_version"]

    async def is_paused(self) -> bool:
        return bool((await self._call("GET", "/is_paused"))["is_paused"])

    async def reload(self, path: str | Path, version: int,
                     changed: list[str] | None = None) -> ReloadReport:
        """Switch the server to the complete HF directory `path` (policy `version`).

        `changed`: checkpoint tensor names that differ from the served version; when given, only
        their modules are reloaded (whole fused q/k/v and gate/up groups), else every tensor.
        """
        real = Path(path).resolve()
        if not (real / "config.json").exists():
            raise ValueError(f"{path} is not an HF model directory (no config.json)")
        mode = "directory" if changed is None else "changed"
        report = ReloadReport(version=version, path=str(real), mode=mode)
        step = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal step
            now = time.perf_counter()
            report.seconds[name] = now - step
            step = now

        await self._call("POST", "/pause", params={"mode": self.pause_mode})
        lap("pause")
        try:
            if changed is None:
                report.worker = await self.rpc("reload_weights", weights_path=str(real))
            else:
                report.worker = await self.rpc("reload_changed", weights_path=str(real),
                                               names=list(changed))
            lap("reload")
            await self._reset_prefix_cache()
            lap("reset_prefix_cache")
            await self._call("POST", "/update_weight_version", json={"new_version": str(version)})
            lap("update_weight_version")
        except (VllmServerError, KeyError, TypeError) as exc:
            raise VllmReloadError(f"reload of version {version} from {real} failed; vLLM left "
                                  f"paused: {exc}") from exc
        await self._call("POST", "/resume")
        lap("resume")
        return report

    async def apply_patch(self, patch_path: str | Path, version: int) -> ReloadReport:
        """In-place sparse apply (GPU): stage the patch on the device while serving, then
        pause -> patch -> reset prefix cache -> weight version -> resume."""
        info = await self.rpc("deltaswarm_info")
        if not all(i.get("patchable") for i in info):
            raise VllmPatchUnsupported(
                f"vLLM holds weights in kernel layout ({info[0].get('empty_params')}): cannot "
                "patch in place; reload the changed tensors instead")
        report = ReloadReport(version=version, path=str(patch_path), mode="patch")
        t0 = time.perf_counter()
        await self.rpc("stage_patch", patch_path=str(patch_path))
        report.seconds["stage"] = time.perf_counter() - t0
        await self._call("POST", "/pause", params={"mode": self.pause_mode})
        try:
            report.worker = await self.rpc("apply_patch", patch_path=str(patch_path))
            await self._reset_prefix_cache()
            await self._call("POST", "/update_weight_version", json={"new_version": str(version)})
        except VllmServerError as exc:
            raise VllmReloadError(f"patch {patch_path} for version {version} failed; vLLM "
                                  f"left paused: {exc}") from exc
        await self._call("POST", "/resume")
        report.seconds["paused"] = time.perf_counter() - t0 - report.seconds["stage"]
        return report

    async def resume(self) -> None:
        await self._call("POST", "/resume")

    async def _reset_prefix_cache(self) -> None:
        out = await self._call("POST", "/reset_prefix_cache",
                               params={"reset_running_requests": "true"})
        if not (out or {}).get("success", False):
            raise VllmServerError(f"reset_prefix_cache refused: {out}")

    async def tokenize(self, prompt: str) -> list[int]:
        out = await self._call("POST", "/tokenize", json={"model": self.model, "prompt": prompt})
        return list(out["tokens"])

    async def generate(self, prompts: list[str], *, n: int = 1, max_tokens: int = 16,
                       temperature: float = 0.0, seed: int | None = None,
                       ignore_eos: bool = False) -> list[Completion]:
        """`n` completions per prompt, prompt-major, each tagged with its weight version."""
        if self.scale_out:
            per_prompt = await asyncio.gather(*(
                self._generate_one(p, n, max_tokens, temperature, seed, ignore_eos)
                for p in prompts))
            return [c for group in per_prompt for c in group]
        return await self._complete(prompts, n, max_tokens, temperature, seed, ignore_eos)

    def _sampling(self, n: int, max_tokens: int, temperature: float, seed: int | None,
                  ignore_eos: bool) -> dict[str, Any]:
        sp: dict[str, Any] = {"n": n, "max_tokens": max_tokens, "temperature": temperature,
                              "logprobs": 0, "ignore_eos": ignore_eos}
        return sp | ({"seed": seed} if seed is not None else {})

    async def _generate_one(self, prompt: str, n: int, max_tokens: int, temperature: float,
                            seed: int | None, ignore_eos: bool) -> list[Completion]:
        prompt_ids = await self.tokenize(prompt)
        out = await self._call("POST", "/inference/v1/generate", json={
            "model": self.model, "token_ids": prompt_ids, "output_mode": "text",
            "sampling_params": self._sampling(n, max_tokens, temperature, seed, ignore_eos)})
        completions = []
        for ch in sorted(out["choices"], key=lambda c: c["index"]):
            spans = ch.get("weight_versions") or []
            versions = [v for v in (version_of(s["version"]) for s in spans) if v is not None]
            completions.append(Completion(
                prompt=prompt, prompt_ids=prompt_ids, text=ch["text"],
                token_ids=list(ch["token_ids"]),
                logprobs=[t["logprob"] for t in (ch.get("logprobs") or {}).get("content") or []],
                version=min(versions) if versions else -1,
                finish_reason=ch.get("finish_reason") or "length",
                extra={"weight_versions": spans}))
        return completions

    async def _complete(self, prompts: list[str], n: int, max_tokens: int, temperature: float,
                        seed: int | None, ignore_eos: bool) -> list[Completion]:
        before = await self.weight_version()
        body = {"model": self.model, "prompt": prompts, "return_token_ids": True,
                **self._sampling(n, max_tokens, temperature, seed, ignore_eos)}
        out = await self._call("POST", "/v1/completions", json=body)
        after = await self.weight_version()
        version = version_of(before) if before == after else None
        choices = sorted(out["choices"], key=lambda c: c["index"])
        return [Completion(
            prompt=prompts[ch["index"] // n], prompt_ids=list(ch["prompt_token_ids"]),
            text=ch["text"], token_ids=list(ch["token_ids"]),
            logprobs=list(ch["logprobs"]["token_logprobs"]),
            version=-1 if version is None else version,
            finish_reason=ch.get("finish_reason") or "length",
            extra={"weight_version_before": before, "weight_version_after": after})
            for ch in choices]


class VllmServerEngine:
    """The rollout worker's synchronous `Engine` over a vLLM server (call it off the event loop,
    e.g. via asyncio.to_thread). `load_version` is the same pause/reload/resume as the hook."""

    def __init__(self, base_url: str, **kwargs: Any) -> None:
        self.hook = VllmServerHook(base_url, **kwargs)
        self._version: int | None = None

    @property
    def version(self) -> int | None:
        return self._version

    def load_version(self, path: str, version: int) -> None:
        asyncio.run(self.hook.reload(path, version))
        self._version = version

    def generate(self, prompts: list[str], n: int, max_tokens: int, temperature: float,
                 seed: int) -> list[Completion]:
        return asyncio.run(self.hook.generate(prompts, n=n, max_tokens=max_tokens,
                                              temperature=temperature, seed=seed))


def main(argv: list[str] | None = None) -> int:
    """`python -m rollout.vllm_server reload URL PATH VERSION`: one hot reload, used by the
    daemon's `type: vllm` engine hook across a process boundary (the daemon never imports
    rollout)."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m rollout.vllm_server", description=main.__doc__)
    p.add_argument("action", choices=["reload"])
    p.add_argument("url", help="base URL of a vllm serve started with VLLM_SERVER_DEV_MODE=1")
    p.add_argument("path", help="a complete, verified HF directory")
    p.add_argument("version", type=int)
    p.add_argument("--timeout", type=float, default=600.0)
    a = p.parse_args(argv)
    try:
        report = asyncio.run(VllmServerHook(a.url, timeout_s=a.timeout).reload(a.path, a.version))
    except (VllmServerError, ValueError, OSError) as e:
        print(f"vllm reload of v{a.version} from {a.path} failed: {e}", file=sys.stderr)
        return 1
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
