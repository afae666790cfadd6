"""The in-place patch (rollout/vllm_patch.py) through a loader-probed layout
(rollout/vllm_patchmap.py), on a toy model whose `load_weights` does what vLLM's does: q/k/v into
row blocks of one fused parameter, and, as tensor-parallel rank 1 of 2, only its half of a
row-split and of a column-split tensor. No vLLM needed (test_vllm_patch_serve runs the real one).
"""

from typing import ClassVar

import numpy as np
import pytest
import torch

from chain import dtypes, lanehash
from chain.patchfile import TensorPatch
from rollout.engine_check import digest_of
from rollout.vllm_patch import Maps, Patcher


class Fused(torch.nn.Module):
    """q (8x4), k (4x4), v (4x4) -> qkv (16x4); rank `rank` of `tp` of col (8x6, rows split)
    and row (4x8, columns split); a norm (6) whole."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {"qkv": ["q", "k", "v"]}

    def __init__(self, state: dict[str, torch.Tensor], rank: int = 0, tp: int = 1) -> None:
        super().__init__()
        self.rank, self.tp = rank, tp
        qkv = torch.cat([state[x] for x in "qkv"])
        self.qkv = torch.nn.Parameter(qkv.clone(), requires_grad=False)
        self.col = torch.nn.Parameter(state["col"].chunk(tp, 0)[rank].clone(),
                                      requires_grad=False)
        self.row = torch.nn.Parameter(state["row"].chunk(tp, 1)[rank].clone(),
                                      requires_grad=False)
        self.norm = torch.nn.Parameter(state["norm"].clone(), requires_grad=False)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        offsets = {"q": (0, 8), "k": (8, 4), "v": (12, 4)}
        for name, w in weights:
            if name in offsets:
                start, n = offsets[name]
                self.qkv.data.narrow(0, start, n).copy_(w)
            elif name == "col":
                n = w.shape[0] // self.tp
                self.col.data.copy_(w.narrow(0, self.rank * n, n))
            elif name == "row":
                n = w.shape[1] // self.tp
                self.row.data.copy_(w.narrow(1, self.rank * n, n))
            else:
                self.norm.data.copy_(w)
        return {n for n, _ in weights}


def states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    shapes = {"q": (8, 4), "k": (4, 4), "v": (4, 4), "col": (8, 6), "row": (4, 8), "norm": (6,)}
    old = {n: torch.randn(s, generator=g).bfloat16() for n, s in shapes.items()}
    new = {n: t.clone() for n, t in old.items()}
    for t in new.values():
        flat = t.view(-1)
        flat[torch.randperm(flat.numel(), generator=g)[:3]] += 1.0
    return old, new


def tensor_patch(name: str, old: torch.Tensor, new: torch.Tensor) -> TensorPatch:
    ob, nb = dtypes.bits_view(old), dtypes.bits_view(new)
    pos = np.flatnonzero(ob != nb).astype(np.int64)
    return TensorPatch(name, "bfloat16", list(old.shape), pos, nb[pos].copy(), digest_of(old),
                       digest_of(new))


def patch_all(model: torch.nn.Module, old: dict, new: dict) -> dict:
    maps = Maps(model)
    patcher = Patcher(model, maps)
    out = {}
    for n in old:
        m = maps.get(n, tuple(old[n].shape), torch.bfloat16)
        assert m is not None, n
        out[n] = patcher.apply(m, tensor_patch(n, old[n], new[n]))
    return out


def test_a_patch_lands_in_the_fused_rows_and_moves_each_digest_to_the_new_one() -> None:
    old, new = states()
    model = Fused(old)
    results = patch_all(model, old, new)
    assert torch.equal(model.qkv.view(torch.int16), torch.cat([new[x] for x in "qkv"])
                       .view(torch.int16))
    assert torch.equal(model.norm.view(torch.int16), new["norm"].view(torch.int16))
    for n, r in results.items():
        assert r.ok and r.digest == digest_of(new[n]), n
        assert r.words <= r.elements


def test_a_corrupted_word_the_patch_touches_is_caught() -> None:
    old, new = states()
    model = Fused(old)
    tp = tensor_patch("k", old["k"], new["k"])
    neighbour = int(tp.indices[0]) ^ 1  # same 64-bit word, not itself patched
    assert neighbour not in tp.indices
    with torch.no_grad():
        model.qkv.view(-1)[8 * 4 + neighbour] += 4.0
    maps = Maps(model)
    r = Patcher(model, maps).apply(maps.get("k", (4, 4), torch.bfloat16), tp)
    assert not r.ok and r.digest != tp.digest


def test_a_tensor_parallel_rank_writes_only_its_slice() -> None:
    old, new = states()
    model = Fused(old, rank=1, tp=2)
    results = patch_all(model, old, new)
    assert torch.equal(model.col.view(torch.int16), new["col"][4:].view(torch.int16))
    assert torch.equal(model.row.view(torch.int16), new["row"][:, 4:].view(torch.int16))
    assert results["col"].ok and results["row"].ok
    assert results["col"].digest is None  # a shard cannot move the whole tensor's digest


def test_a_loader_that_copies_nothing_gives_no_map() -> None:
    old, _ = states()
    model = Fused(old)
    model.load_weights = lambda weights: set()  # type: ignore[method-assign]
    assert Maps(model).get("q", (8, 4), torch.bfloat16) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_digest_moves_from_scattered_words_for_other_widths(dtype: torch.dtype) -> None:
    t = torch.randn(5, 7).to(dtype)
    t2 = t.clone()
    pos = np.array([0, 1, 17, 34], np.int64)
    t2.view(-1)[torch.from_numpy(pos)] += 1
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(t.clone(), requires_grad=False)
    model.load_weights = lambda ws: [model.w.data.copy_(w) for _, w in ws]
    dt = dtypes.of_tensor(t)
    tp = TensorPatch("w", dt.name, [5, 7], pos, dtypes.bits_view(t2)[pos].copy(), digest_of(t),
                     digest_of(t2))
    maps = Maps(model)
    r = Patcher(model, maps).apply(maps.get("w", (5, 7), dtype), tp)
    assert r.ok and r.digest == digest_of(t2) == lanehash.to_hex(*lanehash.from_hex(r.digest))
