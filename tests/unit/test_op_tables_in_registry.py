"""Op knowledge lives in the rule registry (issue 37 item 2): what a stage knows of an op by name
is a trait declared beside the op's rule (``autopar.spmd.registry.declare``; ops without a rule
in autopar/spmd/op_traits.py), asked as ``ops_where(trait)``. The scan below parses every module
of the package outside autopar/spmd and fails on a module-level table (a frozenset, set, tuple,
list or dict, literal or comprehension) of two or more op names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from autopar.collective import CollectiveKind
from autopar.spmd import RULES, declare, ops_where, trait_values
from autopar.spmd.registry import TRAIT_MEANINGS, TRAITS

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "autopar", ROOT / "passes", ROOT / "cost_model"]
# tables of op names still outside the registry, each with why (shrink this, never grow it)
REMAINING = {
    # read by the runtime (the index-feed check, host_plan's sources), which loads no compiler
    # module (autopar.spmd): tests/unit/test_import_cycles.py::test_lower_layers_import_no_upper_layer
    "autopar/index_feeds.py:PASS_THROUGH",
    "autopar/op_kinds.py:CONSTANT_OPS",
    "autopar/op_kinds.py:SOURCE_OPS",
    # not op names: words matched inside op names ("norm" in layer_norm_grad) for check's tolerance
    "autopar/inspect/check.py:MOVES",
    "autopar/inspect/check.py:SUMMING",
}
# words that name ops and also reductions or collective kinds: a table of those alone is no op table
NOT_ONLY_OPS = {"sum", "max", "min", "prod", "avg", "mean"} | {kind.value for kind in CollectiveKind}


def _op_names() -> set[str]:
    names = set(RULES) | set(TRAITS)
    bare = {n.rsplit(".", 1)[-1] for n in names} - NOT_ONLY_OPS
    return bare | {f"pd_op.{n}" for n in names} | {n for n in names if "." in n}


def _strings(node: ast.AST) -> list[str]:
    return [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)]


def _is_table(value: ast.AST) -> bool:
    if isinstance(value, (ast.Set, ast.Tuple, ast.List, ast.Dict, ast.SetComp, ast.ListComp, ast.DictComp, ast.GeneratorExp)):
        return True
    if isinstance(value, ast.BinOp):  # frozenset(...) | {...}
        return _is_table(value.left) or _is_table(value.right)
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in ("frozenset", "set", "tuple", "dict")


def op_tables(top: Path = ROOT, sources: list[Path] = SOURCES) -> set[str]:
    """``path:NAME`` of every module-level table naming two or more ops, outside autopar/spmd
    (a table of reduction words alone, ``("sum", "max")``, is not told from one of ops)."""
    ops = _op_names()
    found = set()
    for root in sources:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(top).as_posix()
            if rel.startswith("autopar/spmd/") or "/profiles/" in rel:
                continue
            for node in ast.parse(path.read_text()).body:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
                value = getattr(node, "value", None)
                if value is None or not _is_table(value):
                    continue
                named = {s.removesuffix("_") for s in _strings(value)} & {o.removesuffix("_") for o in ops}
                suffixes_only = all(len(s) <= 1 for s in _strings(value))
                if len(named) >= 2 and not suffixes_only:
                    found |= {f"{rel}:{t.id}" for t in targets if isinstance(t, ast.Name)}
    return found


def test_no_op_name_table_outside_the_registry():
    assert op_tables() == REMAINING


def test_the_scan_finds_a_table(tmp_path):
    pkg = tmp_path / "autopar"
    pkg.mkdir()
    (pkg / "m.py").write_text('LOCAL = frozenset({"add", "relu"})\nMAP = {"matmul": 2, "exp": 1}\nDTYPES = ("float32", "int64")\n')
    (pkg / "spmd").mkdir()
    (pkg / "spmd" / "x.py").write_text('OPS = ("add", "relu")\n')
    assert op_tables(tmp_path, [pkg]) == {"autopar/m.py:LOCAL", "autopar/m.py:MAP"}


def test_the_old_tables_are_queries_over_the_registry():
    from autopar.cost_model.compute import ELEMENTWISE
    from autopar.rewrites.sequence_parallel import SEQUENCE_LOCAL
    from autopar.suggest.annotations import KEEPS_SPLIT

    assert KEEPS_SPLIT == ops_where("keeps_split") and {"pd_op.matmul", "pd_op.gelu", "builtin.combine"} <= KEEPS_SPLIT
    assert SEQUENCE_LOCAL == ops_where("sequence_local", short=True) and {"layer_norm", "add_", "dropout"} <= SEQUENCE_LOCAL
    assert ELEMENTWISE == trait_values("flops_per_element") and ELEMENTWISE["gelu"] == 8 and ELEMENTWISE["cast"] == 0
    assert all(TRAIT_MEANINGS[t] for t in TRAIT_MEANINGS)


def test_declaring_is_checked():
    with pytest.raises(ValueError, match="unknown op traits \\['keep_split'\\]"):
        declare("relu", keep_split=True)
    with pytest.raises(ValueError, match="gelu already declares flops_per_element=8, not 9"):
        declare("gelu", flops_per_element=9)
    with pytest.raises(ValueError, match="unknown op trait 'shiny'"):
        ops_where("shiny")
