"""The walk of a Strategy through compile: which modules read it, and how often the reads climb
back up the layers (issue 37's measure of how regular the core is).

    .venv/bin/python tools/strategy_walk.py

Every attribute read of a ``Strategy`` (and of the configs it holds) during ``autopar.compile``
is recorded with the module that made it. A module's *layer* is its height in the package's
import graph (tests/unit/test_import_cycles.py's walk): 0 for a module importing none of the
package, else one more than the highest module it imports. The reads, in order, with repeats in
the same module collapsed, form the walk; a *climb* is a step of the walk from a module to one
of a higher layer — the Strategy, handed down, read again above where it was last read. A core
whose strategies are decided once, at the top, and handed down as values walks down once.

Compiled: dp x mp with ZeRO-2 (simple_net), a 2-stage 1F1B pipeline (staged_mlp), mp with
sequence parallelism and recompute (a GPT block), each followed by rank 0's plan (the passes'
emit half). Prints one row per compile and the union.
"""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]


def module_layers() -> dict[str, int]:
    """Each package module's height in the import graph (the import-cycle test's walk)."""
    spec = importlib.util.spec_from_file_location("import_walk", ROOT / "tests/unit/test_import_cycles.py")
    walk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(walk)
    graph: nx.DiGraph = walk.import_graph()
    dag = nx.condensation(graph)  # (a cycle, if any, counts as one module)
    height: dict[int, int] = {}
    for node in reversed(list(nx.topological_sort(dag))):
        height[node] = 1 + max((height[s] for s in dag.successors(node)), default=-1)
    return {m: height[dag.graph["mapping"][m]] for m in graph}


def record_reads(run: Callable[[], object]) -> list[tuple[str, str]]:
    """(module, attribute) of every read of a Strategy / PipelineConfig attribute while ``run`` runs."""
    import autopar.strategy as strategy_module

    classes = [strategy_module.Strategy, strategy_module.PipelineConfig]
    reads: list[tuple[str, str]] = []
    originals = {cls: cls.__getattribute__ for cls in classes}

    def recording(original: Callable) -> Callable:
        def __getattribute__(self, name: str) -> object:  # noqa: N807
            if not name.startswith("__"):
                reads.append((sys._getframe(1).f_globals.get("__name__", "?"), name))
            return original(self, name)

        return __getattribute__

    for cls in classes:
        cls.__getattribute__ = recording(originals[cls])
    try:
        run()
    finally:
        for cls in classes:
            cls.__getattribute__ = originals[cls]
    return reads


def walk_of(reads: list[tuple[str, str]], layers: dict[str, int]) -> tuple[list[str], int]:
    """The walk (package modules outside autopar.strategy, repeats collapsed) and its climbs."""
    walk: list[str] = []
    for module, _ in reads:
        if module in layers and module != "autopar.strategy" and (not walk or walk[-1] != module):
            walk.append(module)
    climbs = sum(layers[b] > layers[a] for a, b in zip(walk, walk[1:]))
    return walk, climbs


def compiles() -> dict[str, Callable[[], object]]:
    import autopar
    from autopar.testing.models import annotate_megatron, gpt_block_program, simple_net
    from autopar.testing.pipeline_models import staged_mlp

    def zero2() -> object:
        mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
        seed = simple_net()
        autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
        return autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(zero_stage=2))

    def pipeline() -> object:
        mesh = autopar.ProcessMesh([0, 1], ["pp"])
        net = staged_mlp(mesh, widths=(64, 128, 64, 10), batch=16)
        config = autopar.PipelineConfig(micro_batches=4, schedule="1F1B")
        return autopar.compile(net.main, mesh, startup_program=net.startup, strategy=autopar.Strategy(pipeline=config))

    def sp_recompute() -> object:
        mesh = autopar.ProcessMesh([0, 1], ["mp"])
        seed = gpt_block_program(layers=2)
        annotate_megatron(seed, mesh)
        strategy = autopar.Strategy(sequence_parallel=True, recompute=True)
        return autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)

    def with_rank_plan(compile_: Callable[[], object]) -> Callable[[], object]:
        return lambda: compile_().rank_plan(0)  # the emit half reads the Strategy too, if it does

    return {
        "dp x mp, ZeRO-2": with_rank_plan(zero2), "pp=2 1F1B, 4 micro-batches": with_rank_plan(pipeline),
        "mp=2 SP + recompute": with_rank_plan(sp_recompute),
    }  # fmt: skip


def main() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    layers = module_layers()
    union: Counter[str] = Counter()
    print(f"{'compile':<30} {'reads':>6} {'modules':>8} {'walk steps':>11} {'climbs':>7}")
    for name, run in compiles().items():
        reads = record_reads(run)
        walk, climbs = walk_of(reads, layers)
        union.update(m for m, _ in reads if m in layers and m != "autopar.strategy")
        print(f"{name:<30} {len(reads):>6} {len({m for m in walk}):>8} {len(walk):>11} {climbs:>7}")
    print(f"\nmodules reading a Strategy in any compile ({len(union)}), with their layer and reads:")
    for module, count in sorted(union.items(), key=lambda item: (-layers[item[0]], item[0])):
        print(f"  {layers[module]:>3}  {module.removeprefix('autopar.'):<40} {count}")


if __name__ == "__main__":
    main()
