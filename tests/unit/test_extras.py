"""Every third-party module a package imports is installed by its extra in pyproject.toml (base
dependencies plus the package's own extra), so `pip install deltaswarm[daemon]` on a region host
runs the daemon without torch, transformers or matplotlib, and nothing any process needs is
missing from its extra."""

import ast
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIRST_PARTY = {"chain", "daemon", "trainer", "rollout", "demo", "deploy"}
EXTRAS = {"chain": [], "daemon": ["daemon"], "trainer": ["trainer"],
          "rollout": ["rollout", "vllm"], "demo": ["demo"], "deploy": ["daemon"]}
# Imported inside a function only to handle the caller's own tensors (StateDictSource, bits_view):
# whoever passes torch tensors to chain has torch.
# trainer/lora.py imports peft only to read the adapter of a PeftModel the caller built.
BRING_YOUR_OWN = {"chain": {"torch"}, "trainer": {"peft"}}
NOT_INSTALLED_HERE = {"vllm": ["vllm"]}  # lives in a separate venv (make vllm-env)


def norm(dist: str) -> str:
    return dist.lower().replace("_", "-")


def requirement_name(req: str) -> str:
    for sep in "<>=![; ":
        req = req.split(sep)[0]
    return req


def declared(extras: list[str]) -> set[str]:
    """Distribution names the base install plus `extras` bring (self-references resolved)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names, todo = set(), list(project["dependencies"])
    todo += [r for e in extras for r in project["optional-dependencies"][e]]
    while todo:
        req = todo.pop()
        if req.startswith("deltaswarm["):
            for e in req[len("deltaswarm["):req.index("]")].split(","):
                todo += project["optional-dependencies"][e]
        else:
            names.add(norm(requirement_name(req)))
    return names


def third_party_imports(package: str) -> set[str]:
    """Top-level modules imported anywhere in `package`, except under `if TYPE_CHECKING:`."""
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text())
        skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                and ast.unparse(node.test) == "TYPE_CHECKING" for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m not in FIRST_PARTY}


@pytest.mark.parametrize("package", sorted(EXTRAS))
def test_every_third_party_import_is_declared_in_the_packages_extra(package):
    dists = {**packages_distributions(), **NOT_INSTALLED_HERE}
    have = declared(EXTRAS[package])
    missing = {}
    for module in third_party_imports(package) - BRING_YOUR_OWN.get(package, set()):
        names = {norm(d) for d in dists.get(module, [module])}
        if not names & have:
            missing[module] = sorted(names)
    assert missing == {}, f"{package} imports these without declaring them: {missing}"


def test_a_region_host_install_has_no_trainer_stack():
    region = declared(["daemon"])
    assert {"torch", "transformers", "tokenizers", "matplotlib", "vllm"}.isdisjoint(region)
    assert {"aiohttp", "libtorrent", "uvloop", "prometheus-client"} <= region
