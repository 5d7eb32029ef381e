"""Layout: the package's imports go one way (issue 37 item 5: no import cycle).

Every module of the installed package (``autopar/``, ``passes/`` as ``autopar.passes``,
``cost_model/`` as ``autopar.cost_model``) is parsed with ``ast``, never imported, and every
import statement counts: module-level ones, lazy ones inside functions and the ones under
``if TYPE_CHECKING:`` (a type a module names is a module it depends on; hiding an import there or
in a function does not break a cycle, moving the code does).

An edge goes from the importing module to each module the statement makes Python run:
- ``import a.b.c`` and ``from a.b.c import name``: ``a.b.c`` and the packages above it (their
  ``__init__`` runs first), except the importer's own packages (already running when it runs);
- ``from a.b import c`` where ``a.b.c`` is a submodule: ``a.b.c`` (and ``a.b`` as above);
  a name defined in ``a.b`` itself: ``a.b`` even when it is the importer's own package, because
  the name must be defined there by then (``from autopar import compile`` inside the package).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
# installed name -> source directory (pyproject.toml's package-dir)
SOURCES = {"autopar": ROOT / "autopar", "autopar.passes": ROOT / "passes", "autopar.cost_model": ROOT / "cost_model"}


def package_modules() -> dict[str, tuple[Path, bool]]:
    """Every module as installed: name -> (file, whether it is a package's ``__init__``)."""
    modules = {}
    for prefix, root in SOURCES.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            if any(not (root.joinpath(*parts[:i]) / "__init__.py").exists() for i in range(1, len(parts))):
                continue  # a folder that is no package (data, scripts)
            modules[".".join([prefix, *parts])] = (path, is_package)
    return modules


def _package_of(name: str, is_package: bool) -> str:
    return name if is_package else name.rpartition(".")[0]


def _resolve(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = _package_of(importer, is_package).split(".")
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(importer: str, path: Path, is_package: bool, modules: set[str]) -> set[str]:
    """The package's modules that ``importer``'s import statements (all of them) make Python run."""
    own = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 1)}
    if is_package:
        own.add(importer)
    found: set[str] = set()

    def running(target: str, named: bool) -> None:
        """``target`` imported; ``named``: a name defined in it is read (it must have run)."""
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            module = ".".join(parts[:i])
            if module in modules and (module not in own or (named and i == len(parts))):
                found.add(module)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                running(alias.name, named=alias.asname is None and "." not in alias.name)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(node, importer, is_package)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in modules:
                    running(sub, named=False)
                else:
                    running(source, named=True)
    found.discard(importer)
    return found


def import_graph() -> nx.DiGraph:
    modules = package_modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, (path, is_package) in modules.items():
        graph.add_edges_from((name, target) for target in imported_modules(name, path, is_package, set(modules)))
    return graph


def _short(module: str) -> str:
    return module.removeprefix("autopar.")


def cycles(graph: nx.DiGraph) -> list[str]:
    """The cycles as module chains: for every import edge inside a group of modules that reach each
    other, the shortest cycle through it (each cycle once, shortest first)."""
    found: set[tuple[str, ...]] = set()
    for group in nx.strongly_connected_components(graph):
        sub = graph.subgraph(group)
        for importer, imported in sub.edges():
            chain = [importer, *nx.shortest_path(sub, imported, importer)[:-1]]
            first = chain.index(min(chain))
            found.add(tuple(chain[first:] + chain[:first]))
    return [" -> ".join(_short(m) for m in [*chain, chain[0]]) for chain in sorted(found, key=lambda c: (len(c), c))]


def test_the_walk_sees_lazy_relative_and_submodule_imports():
    modules = set(package_modules())
    assert {"autopar", "autopar.passes.base", "autopar.cost_model.planner", "autopar.rewrites"} <= modules
    graph = import_graph()
    # autopar/__init__ re-exports compile: an edge to the submodule, none back from it to the package
    assert graph.has_edge("autopar", "autopar.compile")
    # importing autopar.passes.base runs autopar.passes' __init__ first
    assert graph.has_edge("autopar.compile", "autopar.passes")


def test_a_tiny_tree_shows_its_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "autopar"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from autopar.a import f\n")
    (pkg / "a.py").write_text("from . import b\n\ndef f():\n    from .sub import c\n")
    (pkg / "b.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("def g():\n    from autopar import f\n")
    monkeypatch.setitem(SOURCES, "autopar", pkg)
    monkeypatch.delitem(SOURCES, "autopar.passes")
    monkeypatch.delitem(SOURCES, "autopar.cost_model")
    graph = import_graph()
    assert set(graph.successors("autopar.a")) == {"autopar.b", "autopar.sub", "autopar.sub.c"}
    assert set(graph.successors("autopar.sub.c")) == {"autopar"}
    assert cycles(graph) == ["autopar -> a -> sub.c -> autopar"]


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, f"{len(found)} import cycles:\n" + "\n".join(found)


# A lower layer never imports an upper one, not even lazily inside a function or for a type (an
# edge of import_graph(): every import statement). importer (a module or package) -> the modules
# and packages it must not import.
COMPILER = ("autopar.analysis", "autopar.compile", "autopar.rewrites", "autopar.passes", "autopar.propagation",
            "autopar.spmd", "autopar.cost_model", "autopar.distributed_program")  # fmt: skip
ABOVE_THE_COMPILER = ("autopar.inspect", "autopar.suggest", "autopar.testing", "autopar.cli")
LAYERS = {
    # the installed cost model prices and fits; measuring (runtime, Paddle's kernels) is tools/'s job
    "autopar.cost_model": (
        "autopar.runtime",
        "autopar.testing",
        "autopar.inspect",
        "autopar.analysis",
        "autopar.compile",
        "autopar.rewrites",
        "autopar.passes",
        "autopar.suggest",
    ),  # fmt: skip
    # the runtime and the per-rank contract it reads: nothing of the compiler that makes it
    "autopar.runtime": COMPILER + ABOVE_THE_COMPILER,
    "autopar.rank_plan": COMPILER + ABOVE_THE_COMPILER,
    "autopar.index_feeds": COMPILER + ABOVE_THE_COMPILER,
    "autopar.feed_names": ("autopar.",),  # a leaf: the rewrites that make these feeds and the runtime read it
    "autopar.host_comm": ("autopar.runtime", "autopar.cost_model"),
}


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix if prefix.endswith(".") else prefix + ".")


def upward_imports(graph: nx.DiGraph, layers: dict[str, tuple[str, ...]] = LAYERS) -> list[str]:
    """``importer -> imported`` for each import edge a rule of ``layers`` forbids."""
    found = []
    for importer, imported in sorted(graph.edges()):
        for lower, upper in layers.items():
            if _within(importer, lower) and any(_within(imported, u) and not _within(imported, lower) for u in upper):
                found.append(f"{_short(importer)} -> {_short(imported)}")
    return found


def test_a_lazy_upward_import_is_found(tmp_path, monkeypatch):
    pkg = tmp_path / "autopar"
    (pkg / "runtime").mkdir(parents=True)
    (pkg / "rewrites").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "rewrites" / "__init__.py").write_text("")
    (pkg / "rewrites" / "whole_feeds.py").write_text("WHOLE_BATCH = '@whole_batch'\n")
    (pkg / "runtime" / "__init__.py").write_text("")
    (pkg / "runtime" / "runner.py").write_text(
        "def feed():\n    from autopar.rewrites.whole_feeds import WHOLE_BATCH\n"
    )
    monkeypatch.setitem(SOURCES, "autopar", pkg)
    monkeypatch.delitem(SOURCES, "autopar.passes")
    monkeypatch.delitem(SOURCES, "autopar.cost_model")
    graph = import_graph()
    assert not cycles(graph)  # no cycle: only the layering sees it
    assert upward_imports(graph) == ["runtime.runner -> rewrites", "runtime.runner -> rewrites.whole_feeds"]


def test_lower_layers_import_no_upper_layer():
    graph = import_graph()
    assert set(LAYERS) <= set(graph), "a layer names a module that no longer exists"
    found = upward_imports(graph)
    assert not found, f"{len(found)} upward imports:\n" + "\n".join(found)
