"""Cost-based choice between competing placements (the propagation's resolver)."""

from autopar import DistAttr, ProcessMesh
from autopar.cost_model import shipped_profile
from autopar.cost_model.choice import PlacementOption, choose_placement, make_resolver
from autopar.spmd import TensorSpec

MESH = ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])


def test_smaller_total_wins_and_reason_has_both_costs():
    cheap = (DistAttr(MESH, [0, -1]), DistAttr(MESH, [1, -1]), (64, 64), "float32")
    dear = (DistAttr(MESH, [0, -1]), DistAttr(MESH, [-1, -1]), (4096, 4096), "float32")
    choice = choose_placement([PlacementOption("A", (dear,)), PlacementOption("B", (cheap,), compute=1e-6)])
    assert choice.index == 1
    assert choice.totals[1] < choice.totals[0]
    assert choice.reason.startswith("lower cost: B ") and " vs A " in choice.reason
    assert "reshard" in choice.reason and "compute 1us" in choice.reason


def test_ties_keep_the_first_option():
    choice = choose_placement([PlacementOption("A"), PlacementOption("B")])
    assert choice.index == 0 and choice.totals == (0.0, 0.0)


def test_resolver_for_matmul_prefers_moving_the_small_operand():
    # x [8192, 64] split m over dp... both operands propose a split of k: x over dp, w over mp
    x = TensorSpec((8192, 64), DistAttr(MESH, [-1, 0]))
    w = TensorSpec((64, 16), DistAttr(MESH, [1, -1]))
    resolve = make_resolver("mk,kn->mn", [x, w], MESH, shipped_profile("h100-node"))
    pick = resolve("k", [(0, (0,)), (1, (1,))])
    assert pick == 0  # keep the big x where it is; reshard the small w
    where, choice = resolve.choices[0]
    assert where == "k" and len(choice.totals) == 2 and choice.totals[0] < choice.totals[1]
