"""maru's import graph: acyclic at module level and one-way between layers (docs/architecture.md).

Every module under ``maru/`` is parsed with ``ast`` (nothing is imported). An edge A -> B is a
module-level ``import``/``from ... import`` in A naming B (or a module inside B): imports inside
functions and under ``if TYPE_CHECKING:`` run late or never, so they may point back. Package
``__init__`` modules count as modules (``from maru.client import X`` runs ``maru/client/__init__.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

MARU = Path(__file__).resolve().parents[1] / "maru"
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(MARU.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _module_level_imports(tree: ast.Module, module: str, is_package: bool) -> list[str]:
    """Absolute names imported at module level (``from m import x`` gives ``m`` and ``m.x``)."""
    out: list[str] = []

    def visit(stmts: list[ast.stmt]) -> None:
        for node in stmts:
            if isinstance(node, ast.Import):
                out.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    base = module.split(".")
                    if not is_package:
                        base = base[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                out.append(mod)
                out.extend(f"{mod}.{a.name}" for a in node.names)
            elif isinstance(node, ast.If) and not _is_type_checking(node):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for h in node.handlers:
                    visit(h.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(tree.body)
    return out


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(MARU.rglob("*.py"))}


def _ancestors(mod: str) -> set[str]:
    parts = mod.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _graph() -> dict[str, set[str]]:
    """module -> the maru modules it imports at module level, with the packages they sit in."""
    sources = _sources()
    graph: dict[str, set[str]] = {}
    for mod, path in sources.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        deps = set()
        own = _ancestors(mod) | {mod}
        for name in _module_level_imports(tree, mod, path.name == "__init__.py"):
            if name in sources:
                # Importing maru.a.b runs maru/a/__init__.py first, unless that package is being
                # initialised already (it is one of the importer's own ancestors).
                deps.update(m for m in _ancestors(name) | {name} if m in sources and m not in own)
        graph[mod] = deps
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def dfs(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return stack[stack.index(v) :] + [v]
            if v not in state and (found := dfs(v)):
                return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state and (found := dfs(u)):
            return found
    return None


def _imports_of(prefix: str) -> dict[str, set[str]]:
    """Every module under ``prefix`` -> every name it imports anywhere (functions included)."""
    out: dict[str, set[str]] = {}
    for mod, path in _sources().items():
        if mod != prefix and not mod.startswith(prefix + "."):
            continue
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
        out[mod] = names
    return out


def test_the_module_level_import_graph_of_maru_has_no_cycle() -> None:
    graph = _graph()
    assert len(graph) > 50 and graph["maru.transfer.engine"], "the walker found no imports: it is broken"
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def _hits(prefix: str, banned: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{mod} imports {name}"
        for mod, names in _imports_of(prefix).items()
        for name in names
        if any(name == b or name.startswith(b + ".") for b in banned)
    )


def test_transfer_and_kv_ops_never_import_vllm_or_the_connector() -> None:
    assert _hits("maru.transfer", ("vllm", "maru.vllm")) == []
    assert _hits("maru.kv_ops", ("vllm", "maru.vllm")) == []


def test_the_client_never_imports_the_server() -> None:
    assert _hits("maru.client", ("maru.server",)) == []


def test_no_file_under_maru_is_over_600_lines() -> None:
    long = {
        str(p.relative_to(MARU.parent)): n
        for p in MARU.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these by concern (at most {MAX_LINES} lines): {long}"
