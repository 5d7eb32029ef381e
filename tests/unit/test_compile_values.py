"""Compile results are values (issue 37 item 1), checked over the source (and, for the Strategy, one run):

- no dataclass field of a compile result, the RankPlan or the query API is typed ``Any`` (a
  Paddle object is named by its ``paddle.pir`` type under ``TYPE_CHECKING``);
- nothing below autopar/compile_plan.py reads the Strategy: what a strategy decides reaches a pass as a declared
  input of its pass list (``passes_for`` in autopar/compile_plan.py), and a pass a strategy needs
  is one the strategy declares;
- the pass results and the analysis are frozen dataclasses.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# where compile results, the RankPlan and the query API's answers are defined
RESULT_MODULES = sorted(
    [
        *(ROOT / "passes").glob("*.py"),
        *(ROOT / "autopar" / "rewrites").glob("*.py"),
        ROOT / "autopar" / "propagation.py",
        ROOT / "autopar" / "propagation_result.py",
        ROOT / "autopar" / "analysis.py",
        ROOT / "autopar" / "distributed_program.py",
        ROOT / "autopar" / "rank_plan.py",
        ROOT / "autopar" / "strategy.py",
        ROOT / "autopar" / "schedule.py",
        ROOT / "autopar" / "inspect" / "query.py",
    ]
)


def _dataclasses(tree: ast.Module) -> list[ast.ClassDef]:
    def is_dataclass(decorator: ast.expr) -> bool:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        return (isinstance(target, ast.Name) and target.id == "dataclass") or (
            isinstance(target, ast.Attribute) and target.attr == "dataclass"
        )

    return [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and any(map(is_dataclass, node.decorator_list))]


def _names_any(annotation: ast.expr) -> bool:
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):  # a string annotation
        return _names_any(ast.parse(annotation.value, mode="eval").body)
    return any(
        (isinstance(node, ast.Name) and node.id == "Any") or (isinstance(node, ast.Attribute) and node.attr == "Any")
        for node in ast.walk(annotation)
    )


def any_fields(path: Path) -> list[str]:
    """``file:line Class.field: annotation`` for each dataclass field typed with ``Any``."""
    found = []
    for cls in _dataclasses(ast.parse(path.read_text())):
        for statement in cls.body:
            if isinstance(statement, ast.AnnAssign) and _names_any(statement.annotation):
                where = f"{path.relative_to(ROOT)}:{statement.lineno}"
                found.append(f"{where} {cls.name}.{ast.unparse(statement.target)}: {ast.unparse(statement.annotation)}")
    return found


def test_no_compile_result_rank_plan_or_query_answer_has_an_any_field():
    assert RESULT_MODULES and all(path.exists() for path in RESULT_MODULES)
    found = [line for path in RESULT_MODULES for line in any_fields(path)]
    assert found == [], "\n".join(found)


def test_the_any_field_check_finds_one(tmp_path):
    """(The check above can fail: it finds ``Any`` bare, nested, qualified and in a string.)"""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from dataclasses import dataclass\nimport dataclasses, typing\nfrom typing import Any\n"
        "@dataclass(frozen=True)\nclass A:\n    x: int\n    y: 'dict[str, Any]'\n"
        "@dataclasses.dataclass\nclass B:\n    z: typing.Any = None\n    w: tuple[Any, ...] = ()\n"
        "class C:\n    v: Any\n"
    )
    old = globals()["ROOT"]
    globals()["ROOT"] = tmp_path
    try:
        assert [line.split(" ", 1)[1].split(":")[0] for line in any_fields(sample)] == ["A.y", "B.z", "B.w"]
    finally:
        globals()["ROOT"] = old


def strategy_reads(path: Path) -> list[str]:
    """``file:line expression`` for each read of a Strategy's field: ``<x>.strategy.<field>`` or
    ``strategy.<field>``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        inner = node.value
        if (isinstance(inner, ast.Attribute) and inner.attr == "strategy") or (isinstance(inner, ast.Name) and inner.id == "strategy"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    return found


BELOW_THE_PLAN = [
    *sorted((ROOT / "passes").glob("*.py")), *sorted((ROOT / "autopar" / "rewrites").glob("*.py")),
    ROOT / "autopar" / "analysis.py", ROOT / "autopar" / "compile.py", ROOT / "autopar" / "propagation.py",
]  # fmt: skip


def test_nothing_below_the_compile_plan_reads_the_strategy():
    assert len(BELOW_THE_PLAN) > 25
    found = [line for path in BELOW_THE_PLAN for line in strategy_reads(path)]
    assert found == [], "reads the Strategy; read it in autopar/compile_plan.py and hand the value down:\n" + "\n".join(found)
    # the declaration place does read it (the check sees reads where they are)
    assert any("strategy.zero_stage" in line for line in strategy_reads(ROOT / "autopar" / "compile_plan.py"))


def test_a_compile_reads_the_strategy_in_one_module():
    """Run, not parsed: every Strategy / PipelineConfig field read while compiling and building a
    rank plan (ZeRO-2 on dp x mp, a 2-stage pipeline, SP + recompute) is made in
    autopar/compile_plan.py (tools/strategy_walk.py records them)."""
    spec = importlib.util.spec_from_file_location("strategy_walk", ROOT / "tools" / "strategy_walk.py")
    walk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(walk)
    for name, run in walk.compiles().items():
        readers = {module for module, _ in walk.record_reads(run) if module.startswith("autopar")} - {"autopar.strategy"}
        assert readers == {"autopar.compile_plan"}, name


@pytest.mark.parametrize(
    "module, names",
    [
        ("autopar.propagation_result", ["PropagationResult", "PlacementOverride", "ReshardNeed", "ValueState"]),
        ("autopar.passes.results", ["ZeroPlan", "ZeroShard", "ZeroBuckets", "SiteBuckets", "PipelinePlan"]),
        ("autopar.passes.base", ["PlannedReshards", "GradientFusion", "GradientBucket", "AnalysedProgram"]),
        ("autopar.analysis", ["Analysis"]),
        ("autopar.strategy", ["Strategy", "EffectiveStrategy"]),
    ],
)
def test_pass_results_and_the_analysis_are_frozen(module, names):
    import dataclasses
    import importlib

    loaded = importlib.import_module(module)
    for name in names:
        cls = getattr(loaded, name)
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, f"{module}.{name}"


def test_compile_records_the_strategy_it_ran_beside_the_users():
    """Stages placed by shard_op imply a pipeline of one micro-batch: compile runs that Strategy,
    records why, and leaves the user's as given."""
    import autopar
    from autopar.testing.pipeline_models import tied_lm

    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    seed = tied_lm(mesh, (0, 1, 1), seed=3)
    asked = autopar.Strategy()
    dist = autopar.compile(seed.main, mesh, seed.startup, asked)
    effective = dist.effective_strategy
    assert effective.requested is asked and asked.pipeline is None
    assert dist.strategy is effective.strategy and effective.strategy.pipeline == autopar.PipelineConfig()
    assert len(effective.added) == 1 and "sub-meshes" in effective.added[0]
    plain = autopar.compile(*_dp_net(), autopar.Strategy(zero_stage=1))
    assert plain.effective_strategy.added == () and plain.strategy is plain.effective_strategy.requested


def _dp_net():
    import autopar
    from autopar.testing.models import simple_net

    seed = simple_net(batch=8, sizes=(4, 8, 3), optimizer="adam")
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
    return seed.main, mesh, seed.startup
