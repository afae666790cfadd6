"""The built-in engine: a transformers causal LM on CPU (or one GPU) with a hand-written
sampling loop, so it records the exact log-probability of each sampled token.

Weights are loaded from an HF directory (bf16 on disk, run in fp32 by default). A new version
is copied into the existing module's parameters: no re-initialisation, no new module.

Engine first (daemon/engines/first.py): `apply_patch` takes a version as the region's patch file
(chain/patchfile.py) and writes only the changed elements into the live parameters (index_put
on the flat view). The engine keeps each tensor's digest (VERSION.json of the directory it
loaded, then moved by each patch) and checks every patched tensor from the words it touched,
read back from the live parameter in the checkpoint's dtype (chain.lanehash, additive): a patch
that does not land exactly leaves the engine without a version, so it reloads a directory.
"""

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from chain import lanehash
from chain.codec.api import map_jobs
from chain.digest import state_digest
from chain.dtypes import lookup
from chain.errors import ChainError
from chain.patchfile import TensorPatch, read_patch
from chain.versiondir import BadVersionDir, read_info
from rollout import lora_merge
from rollout.engine import Completion

_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class EngineLoadError(ValueError):
    """An HF directory that cannot be loaded into this engine; the message says why."""


class PatchRefused(ValueError):
    """A patch this engine cannot take as it stands (other parent, unknown tensor, no digests):
    nothing was written; load the version's directory instead."""


class PatchMismatch(ValueError):
    """A patch was written but the live weights do not match its digests: the engine has no
    version now and must reload a directory."""


class TorchEngine:
    def __init__(self, path: str | None = None, version: int | None = None,
                 device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.model: torch.nn.Module | None = None
        self.tokenizer = None
        self._version: int | None = None
        self.loads = 0
        self.patches = 0
        self.digests: dict[str, str] | None = None
        """Each tensor's digest in the checkpoint's dtype (None: unknown, patches refused)."""
        self._base_kept: dict[str, torch.Tensor] = {}
        """Base values of the weights an adapter changed (load_adapter)."""
        if path is not None:
            self.load_version(path, 0 if version is None else version)

    @property
    def version(self) -> int | None:
        return self._version

    def load_version(self, path: str | Path, version: int) -> None:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise EngineLoadError(f"{path} is not an HF model directory (no config.json)")
        if self.model is None:
            hf_logging.disable_progress_bar()
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)
            self.model.to(self.device).eval()
        else:
            self._copy_weights(path)
        self._base_kept.clear()  # a new base: adapters now apply over these weights
        self._version = version
        self.loads += 1
        try:
            info = read_info(path)
            self.digests = dict(info.tensors) if info.version == version else None
        except BadVersionDir:
            self.digests = None

    def load_adapter(self, path: str | Path, version: int) -> None:
        """Serve base + the PEFT LoRA adapter in `path` (rollout/lora_merge.py): the adapted
        weights become base + scale·B@A, from the base values kept aside at the first adapter,
        so each new adapter version replaces the last instead of adding to it."""
        assert self.model is not None, "load the base version first"
        adapter, config = lora_merge.read_adapter(Path(path))
        params = dict(self.model.named_parameters())
        deltas = lora_merge.weight_deltas(adapter, config)
        why = lora_merge.misfit(deltas, {n: p.shape for n, p in params.items()})
        if why is not None:
            raise EngineLoadError(f"{path}: {why}: it was trained on another base")
        with torch.no_grad():
            for name in set(self._base_kept) - set(deltas):  # adapted before, not now
                params[name].copy_(self._base_kept.pop(name))
            for name, delta in deltas.items():
                kept = self._base_kept.setdefault(name, params[name].detach().clone())
                params[name].copy_((kept.float() + delta).to(params[name].dtype))
        self._version = version
        self.digests = None  # the live weights are no longer a version directory's

    def apply_patch(self, path: str | Path) -> int:
        """Patch the live weights from a patch file to its version; returns the elements
        written. PatchRefused (nothing written) or PatchMismatch (version dropped)."""
        try:
            patch = read_patch(Path(path))
        except ChainError as e:
            raise PatchRefused(str(e)) from None
        if self.model is None or self._version is None or self._version != patch.parent:
            raise PatchRefused(f"patch v{patch.version} is over v{patch.parent}; the engine is "
                               f"at {self._version}")
        if self.digests is None:
            raise PatchRefused("the engine does not know its tensors' digests (loaded without "
                               "VERSION.json)")
        params = self.model.state_dict()
        for t in patch.tensors:
            p = params.get(t.name)
            if p is None or list(p.shape) != list(t.shape) or not p.is_contiguous():
                raise PatchRefused(f"patch tensor {t.name} does not fit the loaded model")
            if self.digests.get(t.name) != t.parent_digest:
                raise PatchRefused(f"patch v{patch.version} expects another {t.name} than the "
                                   "engine holds")
        digests = dict(self.digests)
        self._version = None  # until every tensor is checked

        def patched(t: TensorPatch) -> str:
            with torch.no_grad():  # per thread
                return self._patch_one(params[t.name], t)

        # tensors spread over the codec's threads: the kernels release the GIL, and a patch
        # is one scattered pass over memory whose misses two threads overlap
        moved = map_jobs(patched, patch.tensors, lambda t: int(t.indices.size))
        for t, digest in zip(patch.tensors, moved, strict=True):
            digests[t.name] = digest
            if digest != t.digest:
                raise PatchMismatch(f"{t.name} does not match patch v{patch.version}'s "
                                    "digest after patching; reload a directory")
        if state_digest(digests) != patch.state_digest:
            raise PatchMismatch(f"the state after patch v{patch.version} does not match its "
                                "state digest; reload a directory")
        self.digests = digests
        self._version = patch.version
        self.patches += 1
        return patch.elements

    def _patch_one(self, param: torch.Tensor, t: TensorPatch) -> str:
        """Write t's values into `param` in place; its new digest, from the touched words
        read back (in the checkpoint dtype) before and after."""
        flat = param.view(-1)
        ck = lookup(t.dtype)
        if param.device.type == "cpu":  # one pass over the changes, in place (chain.lanehash)
            signed = _SIGNED[param.element_size()]
            if param.dtype == ck.torch_dtype:
                bits = flat.view(signed).numpy().view(ck.uint)
                return lanehash.add(t.parent_digest,
                                    lanehash.moved_by_put(bits, t.indices, t.values))
            if param.dtype == torch.float32 and t.dtype == "bfloat16":
                bits = flat.view(torch.int32).numpy().view(np.uint32)
                return lanehash.add(t.parent_digest,
                                    lanehash.moved_by_put_wide(bits, t.indices, t.values, 16))
        sh, _ = lanehash.word_layout(t.values)
        per = 1 << sh
        w = t.indices >> sh  # ascending (read_patch checks nothing more: dups are harmless)
        widx = w[np.concatenate(([True], w[1:] != w[:-1]))] if w.size else w
        elems = (widx[:, None] << sh) + np.arange(per, dtype=np.int64)
        whole = not elems.size or elems[-1, -1] < flat.numel()  # else the last word is short
        valid = None if whole else elems < flat.numel()
        where = torch.from_numpy(elems.reshape(-1) if whole else elems[valid])
        signed = _SIGNED[ck.itemsize]

        def words() -> np.ndarray:
            live = flat[where].to(ck.torch_dtype).view(signed).numpy().view(ck.uint)
            if whole:
                return np.ascontiguousarray(live).view(np.uint64)
            bits = np.zeros(elems.shape, ck.uint)
            bits[valid] = live
            return bits.view(np.uint64).reshape(-1)

        old = words()
        values = torch.from_numpy(t.values.view(np.dtype(f"i{ck.itemsize}")))
        flat.index_copy_(0, torch.from_numpy(t.indices), values.view(ck.torch_dtype)
                         .to(param.dtype))
        new = words()
        return lanehash.add(t.parent_digest, lanehash.moved_by_words(widx, old, new))

    def _copy_weights(self, path: Path) -> None:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise EngineLoadError(f"{path} holds no *.safetensors weights")
        incoming: dict[str, torch.Tensor] = {}
        for f in files:
            incoming.update(load_file(str(f)))
        params = self.model.state_dict()
        missing = sorted(set(params) - set(incoming))
        unknown = sorted(set(incoming) - set(params))
        if missing or unknown:
            raise EngineLoadError(
                f"{path} does not match the loaded model: missing {missing[:5]}, "
                f"unknown {unknown[:5]}; a new architecture needs a new engine"
            )
        with torch.no_grad():
            for name, tensor in params.items():
                if tensor.shape != incoming[name].shape:
                    raise EngineLoadError(
                        f"{path}: {name} has shape {tuple(incoming[name].shape)}, "
                        f"the model has {tuple(tensor.shape)}"
                    )
                tensor.copy_(incoming[name])

    def _cache_kwargs(self, out: object) -> dict:
        """transformers 5.2x renamed `past_key_values` to `cache`; accept both."""
        if "cache" in out:
            return {"cache": out["cache"]}
        return {"past_key_values": out["past_key_values"]}

    @torch.no_grad()
    def generate(self, prompts: list[str], n: int, max_tokens: int, temperature: float = 1.0,
                 seed: int = 0) -> list[Completion]:
        if self.model is None or self._version is None:
            raise RuntimeError("engine has no weights yet: call load_version first")
        if n < 1 or max_tokens < 1 or temperature < 0:
            raise ValueError(f"need n >= 1, max_tokens >= 1, temperature >= 0; got "
                             f"n={n}, max_tokens={max_tokens}, temperature={temperature}")
        tok = self.tokenizer
        prompt_ids = [tok(p)["input_ids"] for p in prompts]
        rows = [ids for ids in prompt_ids for _ in range(n)]
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         use_cache=True)
        batch = len(rows)
        tokens = torch.zeros(batch, max_tokens, dtype=torch.long)
        logps = torch.zeros(batch, max_tokens)
        lengths = torch.full((batch,), max_tokens)
        done = torch.zeros(batch, dtype=torch.bool)
        for t in range(max_tokens):
            logits = out.logits[:, -1].float()
            if temperature == 0:
                logp = torch.log_softmax(logits, -1)
                nxt = logits.argmax(-1)
            else:
                logp = torch.log_softmax(logits / temperature, -1)
                nxt = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
            tokens[:, t] = nxt.cpu()
            logps[:, t] = logp.gather(-1, nxt[:, None]).squeeze(-1).cpu()
            stop = (nxt.cpu() == tok.eos_token_id) & ~done
            lengths[stop] = t + 1
            done |= stop
            if bool(done.all()) or t + 1 == max_tokens:
                break
            mask = torch.cat([mask, mask.new_ones(batch, 1)], -1)
            positions = positions[:, -1:] + 1
            out = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=positions,
                             use_cache=True, **self._cache_kwargs(out))
        completions = []
        for i in range(batch):
            k = int(lengths[i])
            ids = tokens[i, :k].tolist()
            completions.append(Completion(
                prompt=prompts[i // n],
                prompt_ids=rows[i],
                text=tok.decode(ids, skip_special_tokens=True),
                token_ids=ids,
                logprobs=logps[i, :k].tolist(),
                version=self._version,
                finish_reason="stop" if bool(done[i]) else "length",
            ))
        return completions
