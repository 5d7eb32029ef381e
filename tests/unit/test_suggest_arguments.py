"""What ``autopar.suggest`` / ``autopar.price_plan`` accept (issue 36 item 8): each argument in the
forms users reach for, or an AutoparError naming it — never a raw TypeError, ValueError or
AttributeError from inside. Pricing only, one or two mesh shapes each."""

import dataclasses
import warnings

import numpy as np
import pytest

import autopar
from autopar.cost_model.cluster import Cluster, load_cluster
from autopar.errors import AnnotationWarning, AutoparError
from autopar.suggest.search import Shape
from autopar.testing.models import gpt_block_program


def _gpt(batch=8):
    return gpt_block_program(batch=batch, seq=8, hidden=32, heads=4, vocab=64, layers=2, optimizer="sgd", seed=1, layer_calls=True)


@pytest.fixture(scope="module")
def seed():
    return _gpt()


def _suggest(seed, **kwargs):
    kwargs = {"world": 2, "cluster": "h100-node", "shapes": [(2, 1, 1)], **kwargs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.suggest(seed.main, startup_program=seed.startup, **kwargs)


def test_a_cluster_object_is_accepted(seed):
    """A shipped profile's Cluster stands for its name; another is saved as a JSON profile
    (Strategies name profiles by name or path) and prices as that file does."""
    h100 = load_cluster("h100-node")
    by_object, by_name = _suggest(seed, cluster=h100), _suggest(seed)
    assert by_object[0].strategy.cluster == "h100-node" and by_object[0].price == by_name[0].price
    given = autopar.price_plan(seed.main, (2, 1, 1), None, seed.startup, cluster=h100)
    assert given.price == next(p.price for p in by_name if p.strategy == given.strategy)
    small = dataclasses.replace(h100, name="h100-half-node", devices_per_node=2)
    plans = _suggest(seed, world=4, cluster=small, shapes=[(2, 2, 1), (1, 4, 1)])
    assert {p.shape for p in plans} == {Shape(2, 2, 1)}  # 4-way tensor parallelism crosses its nodes of 2
    assert any("would cross nodes of 2 devices" in why for _, why in plans.skipped)
    assert load_cluster(plans[0].strategy.cluster) == small
    given = autopar.price_plan(seed.main, (2, 2, 1), None, seed.startup, cluster=small)
    assert given.price == next(p.price for p in plans if p.strategy == given.strategy)
    with pytest.raises(AutoparError, match=r"suggest: cluster must be a profile name .* got a dict"):
        _suggest(seed, cluster={"name": "h100-node"})


def test_a_memory_size_with_its_unit_is_read_as_the_command_line_reads_it(seed):
    plans = _suggest(seed, memory_per_rank="80GB")
    assert plans[0].budget == 80 * 10**9 and _suggest(seed, memory_per_rank="512 MiB")[0].budget == 512 << 20
    assert _suggest(seed, memory_per_rank=np.int64(2**30))[0].budget == 2**30
    with pytest.raises(AutoparError, match=r"suggest: memory_per_rank 'lots': expected a size such as 80GB"):
        _suggest(seed, memory_per_rank="lots")
    with pytest.raises(AutoparError, match=r"price_plan: memory_per_rank must be bytes per rank .* got -1"):
        autopar.price_plan(seed.main, (2, 1, 1), None, seed.startup, memory_per_rank=-1)


def test_a_budget_nothing_fits_in_says_so_and_hints_at_the_unit(seed):
    with pytest.warns(UserWarning, match=r"nothing fits in 80 B per rank; the least a plan needs is .*KiB"):
        plans = autopar.suggest(seed.main, 2, seed.startup, memory_per_rank=80, cluster="h100-node", shapes=[(2, 1, 1)])
    assert len(plans) == 0 and plans.pruned > 0
    assert plans.notes[0].startswith("nothing fits in 80 B per rank")
    assert "memory_per_rank is in bytes per rank: 80 is 80 bytes; for 80 GB pass memory_per_rank='80GB'" in plans.notes[1]
    assert "note: nothing fits in 80 B per rank" in str(plans) and "'80GB'" in str(plans)
    with pytest.warns(UserWarning, match="nothing fits in 1 KiB per rank") as caught:
        autopar.suggest(seed.main, 2, seed.startup, memory_per_rank="1KiB", cluster="h100-node", shapes=[(2, 1, 1)])
    assert "in bytes" not in str(caught[0].message)  # a size with its unit: no hint about units


def test_integral_numbers_and_lists_are_accepted(seed):
    plans = _suggest(seed, world=np.int64(2), top=np.int32(3), shapes=[[2, 1, 1], np.array([1, 1, 2])])
    assert {p.shape for p in plans} <= {Shape(2, 1, 1), Shape(1, 1, 2)} and len(plans) == 3
    assert autopar.price_plan(seed.main, [2, 1, 1], None, seed.startup, cluster="h100-node").shape == Shape(2, 1, 1)
    for kwargs, message in [
        ({"world": 2.5}, r"suggest: world must be a positive number of devices, got 2.5"),
        ({"world": True}, r"suggest: world must be a positive number of devices, got True"),
        ({"top": "3"}, r"suggest: top must be a positive whole number, got '3'"),
        ({"shapes": [[2, 1]]}, r"suggest: a mesh shape is a Shape or \(dp, mp, pp\) of positive ints, got \[2, 1\]"),
        ({"shapes": (2, 1, 1)}, r"a mesh shape is a Shape or \(dp, mp, pp\) of positive ints, got 2"),
        ({"shapes": "dp"}, r"suggest: shapes must be a list of mesh shapes"),
    ]:
        with pytest.raises(AutoparError, match=message):
            _suggest(seed, **kwargs)


def test_a_compiled_program_or_a_layer_is_refused_saying_what_to_pass(seed):
    import paddle

    dist = autopar.compile(seed.main, autopar.ProcessMesh([0, 1], ["dp"]), seed.startup)
    with pytest.raises(AutoparError, match=r"suggest: program is a DistributedProgram .* pass .*dist.serial_program"):
        autopar.suggest(dist, 2)
    with pytest.raises(AutoparError, match=r"price_plan: program is a DistributedProgram"):
        autopar.price_plan(dist, (2, 1, 1))
    with paddle.static.program_guard(paddle.static.Program(), paddle.static.Program()):  # (its parameters made there)
        layer = paddle.nn.Linear(2, 2)
    with pytest.raises(AutoparError, match=r"suggest: program is an nn.Layer \(Linear\); pass the static training program"):
        autopar.suggest(layer, 2)
    with pytest.raises(AutoparError, match=r"suggest: startup_program must be a Paddle static \(PIR\) program"):
        autopar.suggest(seed.main, 2, "startup")


def test_the_annotations_of_an_annotated_program_are_named_as_not_used():
    """The search places every value itself on each mesh shape (the user's annotations name a
    mesh of another size and dims): it warns that they are not used, and searches as for the
    unannotated program."""
    import paddle

    annotated, plain = _gpt(), _gpt()
    with paddle.static.program_guard(annotated.main, annotated.startup):
        autopar.shard_tensor(annotated.layers["head"].weight, autopar.ProcessMesh([0, 1], ["mp"]), [None, "mp"])
    with pytest.warns(AnnotationWarning, match=r"suggest: the program's own annotations \(1 value\(s\) placed with "
                                               r"shard_tensor / reshard\) are not used"):  # fmt: skip
        plans = autopar.suggest(annotated.main, 2, annotated.startup, cluster="h100-node", shapes=[(1, 2, 1)], top=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the unannotated program: no warning
        expected = autopar.suggest(plain.main, 2, plain.startup, cluster="h100-node", shapes=[(1, 2, 1)], top=1)
    assert plans[0].price == expected[0].price and plans[0].strategy == expected[0].strategy


def test_a_cluster_of_another_kind_in_price_plan_is_named(seed):
    with pytest.raises(AutoparError, match=r"price_plan: cluster must be a profile name"):
        autopar.price_plan(seed.main, (2, 1, 1), None, seed.startup, cluster=8)
    with pytest.raises(AutoparError, match=r"price_plan: strategy must be an autopar.Strategy or None, got a dict"):
        autopar.price_plan(seed.main, (2, 1, 1), {"zero_stage": 1}, seed.startup)
    assert isinstance(load_cluster("h100-node"), Cluster)
