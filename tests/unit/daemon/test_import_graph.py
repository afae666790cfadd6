"""No module in daemon/ imports another that imports it back, not even under TYPE_CHECKING,
and no part but the wiring (node.py, main.py) imports daemon.node: parts get what they use."""

import ast
from pathlib import Path

DAEMON = Path(__file__).resolve().parents[3] / "daemon"


def imports(path: Path) -> set[str]:
    """Every daemon.* module named by an import anywhere in the file (TYPE_CHECKING blocks,
    functions and `from daemon import x` included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("daemon.")}
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "daemon":
                out |= {f"daemon.{a.name}" for a in node.names}
            elif node.module.startswith("daemon."):  # a module, or a room and its modules
                out.add(node.module)
                out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def graph() -> dict[str, set[str]]:
    mods = {"daemon." + ".".join(p.relative_to(DAEMON).with_suffix("").parts): p
            for p in DAEMON.rglob("*.py") if p.stem != "__init__"}
    return {m: imports(p) & mods.keys() for m, p in mods.items()}


def cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(g[m]):
            if state.get(n) == 1:
                return [*stack[stack.index(n):], n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_daemon_modules_import_no_cycle() -> None:
    assert cycle(graph()) is None, " -> ".join(cycle(graph()) or [])


def test_the_cycle_finder_finds_one() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_only_the_wiring_imports_the_node() -> None:
    users = {m for m, deps in graph().items() if "daemon.node" in deps}
    assert users <= {"daemon.main", "daemon.cli"}, users
