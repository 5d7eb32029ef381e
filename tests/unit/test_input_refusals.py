"""Bad input named, not taken silently (issue 36, items 12 and 13): a cluster file that is
binary or a directory, an empty cluster name, a bucket smaller than a byte (named as the user
wrote it, ``allreduce_bucket_mb``), an annotation on a start-up program's value, and a feed
annotated on another build of the program compiled unannotated."""

import warnings

import paddle
import pytest

import autopar
from autopar.errors import AnnotationError, AnnotationWarning, AutoparError
from autopar.testing.models import simple_net

PAIR = autopar.ProcessMesh([0, 1], ["dp"])


def _compile(**strategy):
    net = simple_net(batch=4, sizes=(4, 2))
    autopar.shard_tensor(net.feeds["x"], PAIR, ["dp", None])
    return autopar.compile(net.main, PAIR, startup_program=net.startup, strategy=autopar.Strategy(**strategy))


# ---- Strategy(cluster=...), Strategy(allreduce_bucket_mb=...) ---------------------------
def test_a_binary_cluster_file_is_refused_by_path(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_bytes(bytes([0x80, 0xD5, 0xFF, 0x00, 0x7B]))
    with pytest.raises(AutoparError, match=rf"cluster profile '{path}' is not a text \(JSON\) file"):
        _compile(cluster=str(path))


def test_a_directory_as_cluster_is_refused_by_path(tmp_path):
    with pytest.raises(AutoparError, match=rf"cluster profile '{tmp_path}' is a directory; give a JSON file"):
        _compile(cluster=str(tmp_path))


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_cluster_name_is_refused(name):
    with pytest.raises(AutoparError, match=rf"Strategy.cluster='{name}' names no cluster: give a shipped profile \["):
        autopar.Strategy(cluster=name)


def test_a_bucket_below_one_byte_is_named_as_the_user_wrote_it():
    with pytest.raises(AutoparError, match=r"Strategy.allreduce_bucket_mb=1e-09 is less than one byte") as info:
        autopar.Strategy(allreduce_bucket_mb=1e-9)
    assert "bucket_bytes" not in str(info.value)
    assert autopar.Strategy(allreduce_bucket_mb=1 / (1 << 20)).bucket_bytes == 1


# ---- annotations ----------------------------------------------------------------------
def _startup_value(net):
    """The start-up's initial value of linear1's weight (what set_parameter stores)."""
    name = net.layers["linear1"].weight.name
    for op in net.startup.global_block().ops:
        if op.name() == "builtin.set_parameter" and str(op.attrs()["parameter_name"]) == name:
            return op.operand_source(0), name
    raise AssertionError("no set_parameter for linear1's weight")


@pytest.mark.parametrize(
    "annotate",
    [
        lambda value: autopar.shard_tensor(value, PAIR, [None, "dp"]),
        lambda value: autopar.keep(value),
        lambda value: autopar.reshard(value, PAIR, [None, "dp"]),
    ],
    ids=["shard_tensor", "keep", "reshard"],
)
def test_an_annotation_on_a_startup_value_is_refused(annotate):
    net = simple_net(batch=4, sizes=(4, 2))
    value, name = _startup_value(net)
    with pytest.raises(
        AnnotationError,
        match=rf"is a value of a start-up program \(the initial value of parameter '{name}'\); annotate the main program's",
    ):
        annotate(value)


def test_a_startup_value_inside_program_guard_is_refused_too():
    net = simple_net(batch=4, sizes=(4, 2))
    value, _ = _startup_value(net)
    with paddle.static.program_guard(net.main, net.startup), pytest.raises(AnnotationError, match="start-up program"):
        autopar.shard_tensor(value, PAIR, [None, "dp"])


def test_a_feed_annotated_on_another_build_is_reported_by_name():
    """The user annotates the batch split on one build and compiles another, unannotated:
    data parallelism would be off without a word."""
    first = simple_net(batch=4, sizes=(4, 3))
    second = simple_net(batch=4, sizes=(4, 3))
    autopar.shard_tensor(first.feeds["x"], PAIR, ["dp", None])
    with pytest.warns(AnnotationWarning, match=r"feeds \['x'\] were annotated in another program .* no data parallelism"):
        dist = autopar.compile(second.main, PAIR, startup_program=second.startup)
    assert dist.dist_attr("x").is_replicated


def test_a_program_annotated_on_its_own_leaves_its_feeds_whole_without_a_warning():
    first = simple_net(batch=4, sizes=(4, 3))
    second = simple_net(batch=4, sizes=(4, 3))
    other = simple_net(batch=4, sizes=(4, 5))  # another net: its feed 'x' is not this one's
    autopar.shard_tensor(first.feeds["x"], PAIR, ["dp", None])
    autopar.shard_tensor(other.feeds["x"], PAIR, ["dp", None])
    autopar.shard_tensor(second.layers["linear1"].weight, PAIR, [None, "dp"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autopar.compile(second.main, PAIR, startup_program=second.startup)
    unannotated = simple_net(batch=4, sizes=(4, 7))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autopar.compile(unannotated.main, PAIR, startup_program=unannotated.startup)
