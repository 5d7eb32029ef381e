"""A collective kind is one entry (autopar/collective_kinds.py): its numpy meaning, its lowering
per backend, its price and its reduce ops. Nothing else decodes a kind: the passes, backends and
the cost model ask the table."""

import re
from pathlib import Path

import numpy as np
import pytest

from autopar.collective import Collective, CollectiveKey, CollectiveKind
from autopar.collective_kinds import KINDS, kind_of, perform, perform_for
from autopar.cost_model.comm import COLLECTIVES, coefficients
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
    assert COLLECTIVES == ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
    with pytest.raises(AutoparError, match="unknown collective kind 'gather'"):
        kind_of("gather")


@pytest.mark.parametrize("kind, fields", [("all_reduce", {}), ("all_reduce", {"reduce": "avg"}), ("all_gather", {"axis": 1}),
                                          ("reduce_scatter", {"axis": 1}), ("reduce_scatter", {"reduce": "max"}),
                                          ("all_to_all", {"axis": 0, "split_axis": 1}), ("broadcast", {"root": 1})])  # fmt: skip
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


def test_no_other_module_decodes_a_kind():
    """Branches on a kind's name or enum member live in collective_kinds.py only."""
    decode = re.compile(r"""kind\s*(==|!=|is|is not|in)\s*(\(?["'](all_reduce|all_gather|reduce_scatter|all_to_all|broadcast|slice|make_partial|send_recv)["']|\(?CollectiveKind\.(ALL_REDUCE|ALL_GATHER|REDUCE_SCATTER|ALL_TO_ALL|BROADCAST|SLICE|MAKE_PARTIAL|SEND_RECV)\b)""")
    places = [ROOT / "autopar/runtime", ROOT / "passes/reshard_emission.py", ROOT / "passes/backend_lowering.py",
              ROOT / "cost_model/comm.py", ROOT / "cost_model/planner.py", ROOT / "autopar/collective.py"]  # fmt: skip
    files = [f for p in places for f in ([p] if p.is_file() else sorted(p.glob("*.py")))]
    found = [f"{f.relative_to(ROOT)}:{n}" for f in files for n, line in enumerate(f.read_text().splitlines(), 1) if decode.search(line)]
    assert not found, found
