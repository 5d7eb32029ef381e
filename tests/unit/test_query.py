"""``dist.decisions``, the public query API: per value, per reshard, per strategy feature; and
the command line, the inspection modules, the README and docs/ ask only it (no compile state)."""

import dataclasses
import re
from pathlib import Path

import autopar
from autopar.testing.catalog import build

ROOT = Path(__file__).resolve().parents[2]


def test_a_value_says_its_placement_and_who_decided_it():
    seed, dist = build("simple dp2xmp2")
    d = dist.decisions
    weight = d.value(seed.layers["linear1"].weight.name)
    assert str(weight.placement) == "[R,S(1)]" and weight.decided_by == "user annotation" and weight.kind == "parameter"
    hidden = d.value(weight.key)  # keys work too
    assert hidden == weight
    row_parallel = [v for v in d.values(("activation",)) if v.producer.startswith("pd_op.matmul#") and "P(sum)" in str(v.placement)]
    assert len(row_parallel) == 1 and str(row_parallel[0].placement) == "[S(0),P(sum)]"  # linear2's partial sums
    assert row_parallel[0].decided_by.startswith("pd_op.") and row_parallel[0].layer.startswith("Linear")
    assert d.placement(weight.key) == weight.placement


def test_reshards_say_what_moves_why_and_at_what_price():
    _, dist = build("simple mp2")
    reshards = dist.decisions.reshards()
    row_parallel = [r for r in reshards if "row-parallel output" in r.reason]
    assert len(row_parallel) == 1 and row_parallel[0].kinds == ("all_reduce",) and row_parallel[0].bytes > 0
    assert row_parallel[0].op.startswith("pd_op.add#") and row_parallel[0].site == "before read"
    assert [str(c.kind) for c in dist.decisions.collectives(0)] == [str(c.kind) for c in dist.comm_ops(0)]


def test_strategy_features_as_values():
    _, tied = build("tied lm pp2 ZBH1")
    pipeline = tied.decisions.pipeline()
    assert pipeline.schedule == "ZBH1" and pipeline.micro_batches == 4 and len(pipeline.actions) == 2
    (shared,) = pipeline.shared
    assert shared.name.startswith("embedding_") and shared.owner == pipeline.meshes[0] and shared.copies == (pipeline.meshes[1],)
    _, zero = build("gpt dp2 zero1")
    assert zero.decisions.zero() and all(z.label for z in zero.decisions.zero())
    _, plain = build("simple dp2")
    assert plain.decisions.pipeline() is None and plain.decisions.zero() == () and plain.decisions.sequence() is None
    _, recomputed = build("gpt mp2 recompute")
    assert "kept" in str(recomputed.decisions.recompute()) or recomputed.decisions.recompute().dropped


def test_the_command_line_inspection_and_docs_ask_only_the_query_api():
    # the compile state, and the analysed graph reached through the query API (``decisions.graph``,
    # ``d.graph.ops``, ``graph = ...decisions.graph`` then ``graph.values``): answers only
    internal = re.compile(r"dist\.(state|graph|propagation)\b|\._by_impl|\b(decisions|d)\.graph\b|\.graph\.(values|ops)\b")
    docs = [ROOT / "README.md", ROOT / "benchmarks/RESULTS.md", *(ROOT / "docs").glob("*.md")]
    files = [ROOT / "autopar/cli.py", *docs, *(p for p in (ROOT / "autopar/inspect").glob("*.py") if p.name != "query.py"),
             *(ROOT / "examples").rglob("*.py")]  # fmt: skip
    found = [f"{p.relative_to(ROOT)}:{n}" for p in files for n, line in enumerate(p.read_text().splitlines(), 1) if internal.search(line)]
    assert not found, found


def test_the_query_api_hands_out_no_graph():
    _, dist = build("simple dp2")
    assert not hasattr(dist.decisions, "graph")


def test_ops_and_serial_values_say_what_the_program_is():
    seed, dist = build("simple dp2xmp2")
    d = dist.decisions
    ops, serial = d.ops(), d.serial()
    assert ops == serial.ops and [op.index for op in ops] == list(range(len(ops)))
    matmul = next(op for op in ops if op.name == "pd_op.matmul")
    assert str(matmul) == f"pd_op.matmul#{matmul.index}" and matmul.role.value == "forward" and matmul.layer.startswith("Linear")
    weight = d.value(seed.layers["linear1"].weight.name)
    assert weight.key in matmul.inputs and serial.values[weight.key].label == weight.label
    assert matmul.index in serial.values[weight.key].users and serial.values[matmul.outputs[0]].kind == "activation"
    assert set(d.saved_activations()) <= set(serial.tensor_keys())
    assert hash(matmul) == hash(dataclasses.replace(matmul))


def test_a_value_of_another_program_is_refused_by_name():
    import pytest

    _, dist = build("simple dp2")
    with pytest.raises(autopar.AutoparError, match="no parameter, feed or state named 'nope'"):
        dist.decisions.value("nope")


def test_the_query_api_answers_name_their_types():
    """No answer of the query API (a dataclass field of query.py, a public method's return) is
    typed ``Any`` — but ``program``, which is a Paddle program (issue 37 item 4)."""
    import ast

    tree = ast.parse((ROOT / "autopar/inspect/query.py").read_text())
    vague = []
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and "Any" in ast.unparse(node.annotation):
            vague.append(f"field {ast.unparse(node.target)}: {ast.unparse(node.annotation)}")
        elif isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and node.name != "program":
            if node.returns is not None and "Any" in ast.unparse(node.returns):
                vague.append(f"{node.name}() -> {ast.unparse(node.returns)}")
    assert not vague, vague
