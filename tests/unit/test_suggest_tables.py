"""``autopar.suggest``'s answers in words: a plan's placements print with value names and
layers (not value ids), the skipped candidates with the mesh shape and the strategy's features
(not whole Strategy reprs); both stay a mapping and a tuple a program reads (issue 36 item 16)."""

import re

import autopar
from autopar.graph import ProgramGraph
from autopar.suggest.search import Shape
from autopar.suggest.tables import PlacementTable, Skipped, SkippedPlans, split_words, strategy_words
from autopar.testing.zoo import gpt2


def _plan_and_graph():
    seed = gpt2.build(gpt2.Config(n_layer=2), batch=4, seq=8)
    (plan,) = autopar.suggest(seed.main, world=4, startup_program=seed.startup, top=1, shapes=[(2, 2, 1)])
    return plan, ProgramGraph(seed.main)


def test_a_plans_placements_print_by_value_name_and_layer():
    plan, graph = _plan_and_graph()
    table = PlacementTable(plan.placements, graph)
    text = str(table)
    assert "DistAttr(" not in text and not any(f"({key[0]}, {key[1]})" in text for key in table)
    lines = text.splitlines()
    assert lines[0] == "annotations on mesh(dp=2,mp=2)[0,1,2,3]:"
    assert lines[1].split() == ["value", "kind", "shape", "layer", "placement", "split"]
    # (Paddle numbers names per process: GPT_1/..., embedding_3.w_0 after other builds)
    assert re.fullmatch(r"idx +feed +\[4, 8\] +GPT(_\d+)?/Embedding +\[S\(0\),R\] +dim 0 over dp", lines[2].strip())
    embedding = next(line for line in lines if re.match(r" *embedding_\d+\.w_0 .*\[64, 32\]", line))
    assert re.search(r"parameter +\[64, 32\] +GPT(_\d+)?/Embedding +\[R,S\(0\)\] +dim 0 over mp$", embedding)
    assert any("/MLP/Linear" in line and "dim 1 over mp" in line for line in lines)  # a column-parallel weight
    # still the mapping it was: value keys -> DistAttr, equal to the plan's
    assert table == dict(plan.placements) and len(table) == len(plan.placements) and set(table) == set(plan.placements)
    key = next(iter(plan.placements))
    assert table[key] is plan.placements[key] and dict(table.items()) == dict(plan.placements)
    assert str(table.by_name()["idx"]) == "[S(0),R]" and table.info[key].label in table.by_name()


def test_placements_on_several_meshes_name_the_mesh_per_value():
    pp = autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", "dp"])
    stage0 = autopar.DistAttr(pp[0], dims_mapping=[0, -1])
    assert split_words(stage0) == "dim 0 over dp on mesh(dp=2)[0,1]"
    assert split_words(autopar.DistAttr(pp, dims_mapping=[-1, -1], partial_dims={1})).startswith("partial sum over dp")
    _, graph = _plan_and_graph()
    feed = next(k for k, v in graph.values.items() if v.kind == "feed")
    text = str(PlacementTable({feed: stage0}, graph))  # one mesh: named once above the table
    assert text.splitlines()[0] == "annotations on mesh(dp=2)[0,1]:" and str(PlacementTable({}, graph)).startswith(
        "no annotation"
    )


def test_skipped_candidates_print_shape_and_features_not_strategy_reprs():
    strategy = autopar.Strategy(zero_stage=1, pipeline=autopar.PipelineConfig(micro_batches=4, schedule="ZBH1"))
    skipped = SkippedPlans([
        Skipped(Shape(3, 1, 1), "the batch of 4 rows does not split over 3 data ranks"),
        Skipped(Shape(2, 1, 2), "micro-batching refuses the dropout", strategy),
    ])  # fmt: skip
    text = str(skipped)
    assert "Strategy(" not in text and "cluster" not in text
    assert text.splitlines() == [
        "skipped                         why",
        "dp=3                            the batch of 4 rows does not split over 3 data ranks",
        "dp=2 x pp=2 [ZeRO-1, ZBH1 m=4]  micro-batching refuses the dropout",
    ]
    # still what a program read before: (where, why) pairs, and now the shape and Strategy themselves
    assert [why for _, why in skipped] == [s.why for s in skipped] and skipped[1][0] == "dp=2 x pp=2 [ZeRO-1, ZBH1 m=4]"
    assert skipped[1].strategy is strategy and skipped[0].shape == Shape(3, 1, 1) and skipped[0].strategy is None
    assert isinstance(skipped, tuple) and str(SkippedPlans()) == "nothing skipped"


def test_strategy_words_are_the_plan_table_s_features():
    plan, _ = _plan_and_graph()
    assert strategy_words(plan.strategy) == plan.features
    assert strategy_words(autopar.Strategy()) == "-"
    accumulate = autopar.Strategy(recompute=True, pipeline=autopar.PipelineConfig(micro_batches=2, stages=1))
    assert strategy_words(accumulate) == "recompute, accumulate m=2"
