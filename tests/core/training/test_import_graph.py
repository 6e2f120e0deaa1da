"""deepdpm_core's import graph, read from the source files, has no cycle: every import
counts, those under ``if TYPE_CHECKING:`` and inside functions too (the training loop's
helpers once imported the loop back for their annotations)."""

import ast
from pathlib import Path

import deepdpm_core

ROOT = Path(deepdpm_core.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of deepdpm_core and the modules of deepdpm_core it imports (a package
    counts as its ``__init__``; ``from p import name`` counts ``p.name`` where that is a
    module, else ``p``)."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                source = ".".join(p for p in (base, node.module or "") if p)
                targets.update(f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
                               for a in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules in import order, the first again at the end),
    or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return [*path[path.index(node):], node]
        if node in done:
            return None
        path.append(node)
        for target in sorted(graph[node]):
            if cycle := visit(target):
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        if cycle := visit(node):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_the_imports_of_the_training_loop():
    graph = import_graph()
    assert "deepdpm_core.training.exact_em" in graph["deepdpm_core.training.start"]
    assert "deepdpm_core.training.start" in graph["deepdpm_core.training"]
    assert "deepdpm_core.training" in graph["deepdpm_core.model.estimator"]


def test_deepdpm_core_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
