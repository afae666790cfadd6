"""Reading checkpoint tensors back out of a vLLM-shaped model (fused q/k/v and gate/up blocks,
padded vocabulary rows, weights emptied by kernel repacking) and comparing them with the
version's digests (rollout/engine_check.py; the real vLLM run is test_vllm_swarm)."""

import torch

from chain.digest import tensor_digest
from rollout.engine_check import check, locate

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def ckpt() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).bfloat16()

    return {"model.embed_tokens.weight": r(10, 8),
            "model.layers.0.self_attn.q_proj.weight": r(8, 8),
            "model.layers.0.self_attn.k_proj.weight": r(4, 8),
            "model.layers.0.self_attn.v_proj.weight": r(4, 8),
            "model.layers.0.mlp.gate_proj.weight": r(12, 8),
            "model.layers.0.mlp.up_proj.weight": r(12, 8),
            "model.norm.weight": r(8)}


class Runtime(torch.nn.Module):
    """Parameters under vLLM's runtime names, built from a checkpoint as vLLM's loaders do."""

    packed_modules_mapping = PACKED

    def __init__(self, c: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16,
                 pad_rows: int = 6) -> None:
        super().__init__()
        p = "model.layers.0."
        emb = c["model.embed_tokens.weight"]
        params = {
            "model.embed_tokens.weight": torch.cat([emb, torch.full((pad_rows, 8), 7.0)]),
            p + "self_attn.qkv_proj.weight": torch.cat(
                [c[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
            p + "mlp.gate_up_proj.weight": torch.cat(
                [c[p + "mlp.gate_proj.weight"], c[p + "mlp.up_proj.weight"]]),
            "model.norm.weight": c["model.norm.weight"]}
        for name, t in params.items():
            *path, leaf = name.split(".")
            mod = self
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, torch.nn.Parameter(t.to(dtype), requires_grad=False))


def digests(c: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: tensor_digest("bfloat16", list(t.shape), t.contiguous().view(torch.int16).numpy()
                             .reshape(-1).view("uint16")) for n, t in c.items()}


def run(model: torch.nn.Module, c: dict[str, torch.Tensor]):
    return check(model, 3, digests(c), {n: tuple(t.shape) for n, t in c.items()},
                 {n: t.dtype for n, t in c.items()})


def test_every_tensor_of_a_faithful_load_is_read_back_and_matches() -> None:
    c = ckpt()
    res = run(Runtime(c), c)
    assert (res.ok, res.checked, res.mismatched, res.unreadable) == (True, len(c), [], [])


def test_one_changed_element_inside_a_fused_block_names_that_tensor_only() -> None:
    c = ckpt()
    model = Runtime(c)
    with torch.no_grad():
        model.get_parameter("model.layers.0.self_attn.qkv_proj.weight")[13, 3] += 1.0  # v row 1
    res = run(model, c)
    assert res.ok is False
    assert res.mismatched == ["model.layers.0.self_attn.v_proj.weight"]
    assert res.checked == len(c) - 1


def test_a_model_served_in_float32_is_compared_in_the_checkpoints_dtype() -> None:
    c = ckpt()
    assert run(Runtime(c, dtype=torch.float32), c).ok is True


def test_weights_emptied_by_kernel_repacking_are_unreadable_never_counted_as_checked() -> None:
    c = ckpt()
    model = Runtime(c)
    model.get_submodule("model.layers.0.mlp").gate_up_proj.weight = torch.nn.Parameter(
        torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
    res = run(model, c)
    assert res.ok is True and res.checked == len(c) - 2
    assert res.unreadable == ["model.layers.0.mlp.gate_proj.weight",
                              "model.layers.0.mlp.up_proj.weight"]


def test_nothing_readable_is_unverified_not_passed() -> None:
    c = {"model.layers.0.mlp.down_proj.weight": torch.ones(2, 2).bfloat16()}
    res = run(Runtime(ckpt()), c)
    assert res.ok is None and res.unreadable == list(c)


def test_a_tensor_parallel_shard_or_a_wrong_fused_size_is_not_located() -> None:
    shapes = {"a.q_proj.weight": (8, 8), "a.k_proj.weight": (4, 8), "a.v_proj.weight": (4, 8),
              "b.weight": (8, 8)}
    assert locate("b.weight", shapes, {"b.weight": (4, 8)}, PACKED) is None  # a TP shard
    assert locate("b.weight", shapes, {"b.weight": (8, 4)}, PACKED) is None
    assert locate("a.k_proj.weight", shapes, {"a.qkv_proj.weight": (8, 8)}, PACKED) is None
    loc = locate("a.k_proj.weight", shapes, {"a.qkv_proj.weight": (16, 8)}, PACKED)
    assert loc is not None and (loc.param, loc.start, loc.rows) == ("a.qkv_proj.weight", 8, 4)
