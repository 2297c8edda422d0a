"""The import graph of pt2serve/: no circles, and the runtime never reaches model or export code.

Read from the source with `ast`, not by importing: every import statement counts, including those deferred
inside functions (a lazy import that closes a circle is still a circle of the design), relative or absolute,
and `from pt2serve.x import y` names the submodule pt2serve.x.y when there is one.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pt2serve"

# README, "How it fits together": the runtime loads artifacts; it never imports model or export code.
RUNTIME = "pt2serve.runtime"
BEYOND_RUNTIME = ("pt2serve.model", "pt2serve.export")


def module_files() -> dict[str, Path]:
    files = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The pt2serve modules that `name` names in any import statement."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in known else source)
    return {target for target in found if target in known}


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def path_between(graph: dict[str, set[str]], start: str, targets: tuple[str, ...]) -> list[str] | None:
    """The shortest import chain from `start` to a module in or under one of `targets`, if any."""
    came_from: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target in came_from:
                    continue
                came_from[target] = node
                if any(target == t or target.startswith(t + ".") for t in targets):
                    chain = [target]
                    while came_from[chain[-1]] is not None:
                        chain.append(came_from[chain[-1]])
                    return chain[::-1]
                following.append(target)
        frontier = following
    return None


def test_every_kind_of_import_counts(tmp_path):
    known = {"pt2serve", "pt2serve.contract", "pt2serve.errors", "pt2serve.bench", "pt2serve.bench.options",
             "pt2serve.bench.stats", "pt2serve.kernels", "pt2serve.kernels.linear_choice", "pt2serve.runtime",
             "pt2serve.runtime.engine"}
    module = tmp_path / "sweep.py"
    module.write_text(textwrap.dedent("""
        import numpy
        import pt2serve.errors
        from pt2serve.kernels import linear_choice
        from pt2serve.bench.options import RequestsOptions
        from . import stats
        from .. import contract

        def later():
            from pt2serve.runtime import engine
    """))
    assert imported_modules("pt2serve.bench.sweep", module, known) == {
        "pt2serve.errors", "pt2serve.kernels.linear_choice", "pt2serve.bench.options", "pt2serve.bench.stats",
        "pt2serve.contract", "pt2serve.runtime.engine"}
    package = tmp_path / "__init__.py"
    package.write_text("from .options import RequestsOptions\nfrom . import stats\nfrom pt2serve.bench import X\n")
    assert imported_modules("pt2serve.bench", package, known) == {
        "pt2serve.bench.options", "pt2serve.bench.stats", "pt2serve.bench"}


def test_the_graph_holds_every_module():
    graph = import_graph()
    assert len(graph) == len(list(PACKAGE.rglob("*.py")))
    assert "pt2serve.runtime.engine" in graph["pt2serve.cli"]  # imported inside a command


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The components of more than one module, and the modules that import themselves."""
    found = [component for component in strongly_connected(graph) if len(component) > 1]
    return found + [[name] for name in sorted(graph) if name in graph[name]]


def chains_beyond_runtime(graph: dict[str, set[str]]) -> list[list[str]]:
    starts = [name for name in sorted(graph) if name == RUNTIME or name.startswith(RUNTIME + ".")]
    return [chain for chain in (path_between(graph, name, BEYOND_RUNTIME) for name in starts) if chain]


def test_circles_and_chains_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"d"}, "e": {"a"},
             "pt2serve.runtime.x": {"e"}, "pt2serve.model.y": set()}
    assert circles(graph) == [["a", "b", "c"], ["d"]]
    assert chains_beyond_runtime(graph) == []
    graph["d"] = {"pt2serve.model.y"}
    assert chains_beyond_runtime(graph) == [["pt2serve.runtime.x", "e", "a", "b", "c", "d", "pt2serve.model.y"]]


def test_no_module_imports_itself_or_sits_on_a_circle():
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_runtime_never_reaches_model_or_export_code():
    chains = chains_beyond_runtime(import_graph())
    assert not chains, "runtime imports reaching model/export:\n" + "\n".join(" -> ".join(c) for c in chains)
