"""Feeds read as indices are checked on the way in (issue 36, item 12): a label out of the
logits' class range, an embedding id past the table, is an AutoparError naming the feed, the
op, the bound and the value — not Paddle's IndexError from inside the interpreter, nor (a
label of 2**40) a segfault in its cross-entropy backward (autopar/runtime/index_feeds.py)."""

import numpy as np
import pytest

import autopar
from autopar.errors import AutoparError
from autopar.graph import ProgramGraph
from autopar.index_feeds import index_uses
from autopar.testing.models import simple_net
from autopar.testing.zoo import gpt2


def _simple():
    net = simple_net(batch=8, sizes=(8, 16, 4), optimizer="sgd")
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(net.feeds["x"], mesh, ["dp", None])
    return net, autopar.compile(net.main, mesh, startup_program=net.startup)


def _feed(label_value):
    rng = np.random.default_rng(0)
    label = rng.integers(0, 4, (8, 1)).astype("int64")
    label[3, 0] = label_value
    return {"x": rng.standard_normal((8, 8)).astype("float32"), "label": label}


@pytest.mark.parametrize("value", [4, -1, 2**40])
def test_label_out_of_the_class_range_is_refused_by_name(value):
    net, dist = _simple()
    message = (
        rf"feed 'label' is the label of cross_entropy_with_softmax \(op #\d+\): each value must be in \[0, 4\) "
        rf"or -100 \(its ignore_index\) \(the classes: dim 1 of its input \[8, 4\]\); element \[3, 0\] is {value} "
        r"\(1 of 8 out of range\)"
    )
    with pytest.raises(AutoparError, match=message):
        autopar.simulate(dist, [_feed(value)], fetch_list=[net.loss])


def test_ignore_index_and_every_class_are_accepted():
    net, dist = _simple()
    for value in (-100, 0, 3):
        loss = autopar.simulate(dist, [_feed(value)], fetch_list=[net.loss]).fetches[0][0]
        assert np.isfinite(loss)


class _OneRank:
    """The communicator of a one-rank job in this process."""

    def run(self, job, x):
        raise AssertionError(f"a one-rank job has no collective, got {job}")

    def all_gather_object(self, obj):
        return [obj]


def test_executor_refuses_an_out_of_range_label():
    net = simple_net(batch=8, sizes=(8, 16, 4), optimizer="sgd")
    dist = autopar.compile(net.main, autopar.ProcessMesh([0], ["dp"]), startup_program=net.startup)
    exe = autopar.Executor(dist, rank=0, backend="host", communicator=_OneRank())
    exe.run_startup()
    exe.run(_feed(3), fetch_list=[net.loss])
    with pytest.raises(AutoparError, match=r"feed 'label' is the label of cross_entropy_with_softmax .* element \[3, 0\] is 7"):
        exe.run(_feed(7), fetch_list=[net.loss])


def _gpt(strategy=None):
    config = gpt2.Config()
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    seed = gpt2.build(config, batch=4, seq=8, mesh=None)
    autopar.shard_tensor(seed.feeds["idx"], mesh, ["dp", None])
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    return config, seed, dist


def test_token_id_past_the_embedding_table_is_refused():
    config, seed, dist = _gpt()
    feed = gpt2.feeds(config, 4, 8, 1)[0]
    feed["idx"][1, 5] = config.vocab_size
    with pytest.raises(
        AutoparError,
        match=rf"feed 'idx' is the x of embedding \(op #\d+\): each value must be in \[0, {config.vocab_size}\) "
        rf"\(the rows of the table: dim 0 of its weight \[{config.vocab_size}, \d+\]\); element \[1, 5\] is {config.vocab_size}",
    ):
        autopar.simulate(dist, [feed], fetch_list=[seed.loss])


def test_labels_of_accumulated_micro_batches_are_checked():
    config, seed, dist = _gpt(autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2, stages=1)))
    feed = gpt2.feeds(config, 4, 8, 1)[0]
    feed["targets"][3, 7] = -5
    with pytest.raises(AutoparError, match=r"feed 'targets' is the label of cross_entropy_with_softmax .* element \[3, 7\] is -5"):
        autopar.simulate(dist, [feed], fetch_list=[seed.loss])


def test_index_feeds_found_through_views_with_their_bounds():
    import paddle

    paddle.enable_static()
    F = paddle.nn.functional
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [8, 5], "float32")
        label = paddle.static.data("label", [8], "int32")
        classes = paddle.static.data("classes", [8], "int64")
        rows = paddle.static.data("rows", [8], "int64")
        data = paddle.static.data("data", [8], "int64")
        F.cross_entropy(x, label.astype("int64").reshape([8, 1]), ignore_index=2)  # ignore_index a class itself
        F.nll_loss(F.log_softmax(x), classes, ignore_index=-1)
        F.one_hot(classes, 5)
        paddle.gather(x, rows)
        x[:, 0].astype("int64") + data  # no index
    uses = {name: sorted(str(use) for use in found) for name, found in index_uses(ProgramGraph(main)).items()}
    assert set(uses) == {"label", "classes", "rows"}
    assert len(uses["label"]) == 1 and uses["label"][0].startswith("the label of cross_entropy_with_softmax")
    assert ": [0, 5), the classes: dim 1 of its input [8, 5]" in uses["label"][0]
    assert [u.split(" (op")[0] for u in uses["classes"]] == ["the label of nll_loss", "the x of one_hot"]
    assert "[0, 5) or -1 (its ignore_index)" in uses["classes"][0] and "[0, 5), the classes: its num_classes" in uses["classes"][1]
    assert uses["rows"] == [u for u in uses["rows"] if "[-8, 8), the size indexed: dim 0 of its x [8, 5]" in u] != []
