"""A collective kind is one entry (autopar/collective_kinds.py): its numpy meaning, its lowering
per backend, its price, its reduce ops and what the passes ask of it (``reduces``, ``sends``,
``gradient_sync``, ...). Nothing else in the package decodes a kind: the passes, backends, the
cost model, the CLI and the inspection modules ask the table (the guard below reads them all)."""

import ast
from pathlib import Path

import numpy as np
import pytest

from autopar.collective import Collective, CollectiveKey, CollectiveKind
from autopar.collective_kinds import KINDS, Kind, kind_of, local, perform, perform_for, step_kinds
from autopar.cost_model.comm import COLLECTIVES, coefficients
from autopar.cost_model.planner import STEP_KINDS
from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.mesh import ProcessMesh

ROOT = Path(__file__).resolve().parents[2]
MESH = ProcessMesh([0, 1], ["x"])


def job(kind, **fields):
    whole = DistAttr.replicated(MESH, 2)
    return Collective(kind=kind, group=(0, 1), key=CollectiveKey("test", 0), value="v", src=whole, dst=whole,
                      shape=(2, 4), output_shape=(2, 4), bytes=32, time=0.0, reason="test", **fields)  # fmt: skip


def test_every_kind_has_one_entry():
    assert set(KINDS) == set(CollectiveKind)
    assert COLLECTIVES == (
        "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "permute", "all_to_all_v", "broadcast", "send_recv"
    )
    assert STEP_KINDS == step_kinds() and set(CollectiveKind) - set(STEP_KINDS) == {CollectiveKind.SEND, CollectiveKind.RECV}
    with pytest.raises(AutoparError, match="unknown collective kind 'gather'"):
        kind_of("gather")


def test_the_vocabulary_and_the_table_agree_on_local_kinds():
    # a member declares is_local (a Collective validates its kind by it); the table's Local entries are those kinds
    assert {kind for kind in CollectiveKind if kind.is_local} == {kind for kind in CollectiveKind if local(kind)}
    assert CollectiveKind("slice").is_local and CollectiveKind.SLICE == "slice" and not CollectiveKind.SEND.is_local


@pytest.mark.parametrize("kind, fields", [("all_reduce", {}), ("all_reduce", {"reduce": "avg"}), ("all_gather", {"axis": 1}),
                                          ("reduce_scatter", {"axis": 1}), ("reduce_scatter", {"reduce": "max"}),
                                          ("all_to_all", {"axis": 0, "split_axis": 1}), ("broadcast", {"root": 1}),
                                          ("permute", {"shift": 1}), ("all_to_all_v", {"splits": ((2, 4), (5, 1))}),
                                          ("all_to_all_v", {"axis": 1, "split_axis": 0, "splits": ((4, 2), (4, 2))})])  # fmt: skip
def test_one_members_output_alone_is_bit_equal_to_the_whole_collectives(kind, fields):
    """What the host communicators compute for their own rank (a reduce_scatter reduces its own
    piece of each input only) is exactly that rank's output of the whole collective."""
    rng = np.random.default_rng(0)
    inputs = {r: rng.standard_normal((6, 10)).astype(np.float32) * 100 for r in (0, 1)}
    collective = job(kind, **fields)
    whole = perform(collective, inputs)
    for rank in (0, 1):
        assert np.array_equal(perform_for(collective, inputs, rank), whole[rank])


def test_numpy_meanings():
    a, b = np.arange(8.0).reshape(2, 4), np.ones((2, 4))
    assert np.array_equal(perform(job("all_reduce"), {0: a, 1: b})[1], a + b)
    assert np.array_equal(perform(job("all_reduce", reduce="max"), {0: a, 1: b})[0], np.maximum(a, b))
    assert perform(job("all_gather"), {0: a, 1: b})[0].shape == (4, 4)
    scattered = perform(job("reduce_scatter"), {0: a, 1: b})
    assert np.array_equal(np.concatenate([scattered[0], scattered[1]]), a + b)
    exchanged = perform(job("all_to_all", axis=1, split_axis=0), {0: a, 1: b})
    assert exchanged[0].shape == (1, 8) and np.array_equal(exchanged[0][:, :4], a[:1])
    assert np.array_equal(perform(job("broadcast", root=1), {0: a, 1: b})[0], b)
    assert set(perform(job("send"), {0: a, 1: b})) == {1}


def test_prices_come_from_the_entries():
    assert coefficients("all_reduce", 4, 100.0) == (6.0, 150.0)
    assert coefficients("all_reduce", 4, 100.0, "tree") == (4.0, 200.0)
    assert coefficients("send_recv", 2, 10.0) == (1.0, 10.0)
    assert kind_of("reduce_scatter").emulated_by is CollectiveKind.ALL_REDUCE and kind_of("all_to_all").emulated_by is CollectiveKind.ALL_GATHER


KIND_NAMES = {kind.value for kind in CollectiveKind} | {kind.name for kind in CollectiveKind}
KIND_CLASSES = {cls.__name__ for cls in (type(entry) for entry in KINDS.values()) for cls in cls.__mro__ if issubclass(cls, Kind)}
PACKAGE = [ROOT / "autopar", ROOT / "passes", ROOT / "cost_model"]  # (pyproject.toml: passes/, cost_model/ install as autopar.*)
TABLE = ROOT / "autopar/collective_kinds.py"


def _names_a_kind(node: ast.AST) -> bool:
    """``node`` holds a kind's name (``"send"``) or member (``CollectiveKind.SEND``)."""
    return any(
        (isinstance(n, ast.Constant) and n.value in KIND_NAMES)
        or (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "CollectiveKind")
        for n in ast.walk(node)
    )


def _kind_value(node: ast.AST) -> bool:
    """``node`` reads ``<x>.kind.value`` (a kind compared by its text)."""
    return any(isinstance(n, ast.Attribute) and n.attr == "value" and isinstance(n.value, ast.Attribute) and n.value.attr == "kind"
               for n in ast.walk(node))  # fmt: skip


def _kind_list(elements: list) -> bool:
    """A literal list of two kinds or more (names or members) and nothing else (a list of op
    names that holds ``"all_reduce"`` is not one)."""
    return len(elements) >= 2 and all(
        (isinstance(e, ast.Constant) and e.value in KIND_NAMES)
        or (isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "CollectiveKind")
        for e in elements
    )


def decodes(source: str) -> list[int]:
    """Lines of ``source`` that decode a collective kind: a comparison naming a kind (by name or
    member, send / recv included) or reading ``.kind.value``, a literal list or set of kinds, a
    dict keyed by kinds, a ``match`` case on a kind."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            found = any(_names_a_kind(o) or _kind_value(o) for o in (node.left, *node.comparators))
        elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            found = _kind_list(node.elts)
        elif isinstance(node, ast.Dict):
            found = any(k is not None and _kind_list([k, k]) for k in node.keys)
        elif isinstance(node, ast.match_case):
            found = _names_a_kind(node.pattern)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "issubclass"):
            found = any(isinstance(n, ast.Name) and n.id in KIND_CLASSES for n in ast.walk(node.args[-1]))
        else:
            found = False
        if found:
            lines.add(node.pattern.lineno if isinstance(node, ast.match_case) else node.lineno)
    return sorted(lines)


@pytest.mark.parametrize("line", [
    'if kind == "all_gather": pass', 'if c.kind.value in ("send", "recv"): pass', 'x = step.kind is CollectiveKind.SEND',
    'ok = k != "send_recv" or world == 2', 'if kinds == [CollectiveKind.ALL_REDUCE]: pass', 'table = {"all_reduce": 1, "broadcast": 2}',
    'if job.kind.value == name: pass', 'match kind:\n    case "recv": pass', 'if c.kind.name == "SEND": pass',
    'if isinstance(KINDS[kind], PointToPoint): pass',
])  # fmt: skip
def test_the_guard_sees_a_decoded_kind(line):
    assert decodes(line)


def test_the_guard_lets_kinds_be_made_and_asked():
    assert decodes('c = Collective(kind=CollectiveKind.SEND)\nif kind_of(c.kind).sends: pass\nops = {"print", "all_reduce", "send_v2"}') == []


def test_no_other_module_decodes_a_kind():
    """Branches on a kind (its name, its member or its ``.value``; send / recv included) live in
    collective_kinds.py only: everywhere else in the package asks the kind's entry."""
    files = [f for place in PACKAGE for f in sorted(place.rglob("*.py")) if f != TABLE]
    found = [f"{f.relative_to(ROOT)}:{n}" for f in files for n in decodes(f.read_text())]
    assert not found, found


def test_the_planners_moves_are_the_tables(monkeypatch):
    """The planner's edges are the entries' ``move``s: taking all_to_all's away makes S(0) -> S(1)
    an all_gather then a slice; the kinds it never plans (permute, all_to_all_v) have none."""
    from autopar.collective_kinds import AllToAll, moves_from
    from autopar.cost_model import planner
    from autopar.cost_model.cluster import shipped_profile
    from autopar.placement import Partial, Replicate, Shard

    assert moves_from(Partial) == ((CollectiveKind.ALL_REDUCE, Replicate), (CollectiveKind.REDUCE_SCATTER, Shard))
    assert moves_from(Shard) == ((CollectiveKind.ALL_GATHER, Replicate), (CollectiveKind.ALL_TO_ALL, Shard))
    assert moves_from(Replicate) == ((CollectiveKind.SLICE, Shard), (CollectiveKind.MAKE_PARTIAL, Partial))
    assert kind_of("permute").move is None and kind_of("all_to_all_v").move is None
    mesh, cluster = ProcessMesh([0, 1, 2, 3], ["x"]), shipped_profile("h100-node")
    src, dst = DistAttr.of(mesh, ((0,), ())), DistAttr.of(mesh, ((), (0,)))

    def kinds() -> list[str]:
        planner._planned.cache_clear()
        planner._plan_cached.cache_clear()
        planner._edges_cached.cache_clear()
        return [str(k) for k in planner.plan_reshard(src, dst, (64, 64), "float32", cluster).kinds()]

    assert kinds() == ["all_to_all"]
    monkeypatch.setattr(AllToAll, "move", None)
    assert kinds() == ["all_gather", "slice"]
    monkeypatch.undo()
    assert kinds() == ["all_to_all"]
