"""The automatic cut of ``PipelineConfig(stages=n)`` (autopar/rewrites/pipeline_cut.py): each stage is one
contiguous run of whole layers. Before, every distinct ``struct_name`` path was a layer, and a
residual block's add (recorded under the block's own path) went back to an earlier stage: one
residual block + a head on two stages ran mesh0 -> mesh1 -> mesh0 (1F1B refused it: rank 0 had
two stages), two blocks were cut inside the second."""


import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import autopar
from autopar.errors import AnnotationError
from autopar.rewrites.pipeline_cut import cut_stages
from autopar.testing.serial import run_serial

pytestmark = pytest.mark.filterwarnings("ignore")

# the forward ops of Block(x) = x + Linear_1(gelu(Linear(LayerNorm(x)))), as Paddle names them
BLOCK = [("LayerNorm",), ("Linear",), ("Linear",), (), ("Linear_1",), ("Linear_1",), ()]


def _block(name):
    return [(name, *sub) for sub in BLOCK]


def test_a_residual_block_is_never_cut_inside():
    head = [("LayerNorm",), ("Linear",), ("Linear",), None, None, None]  # the loss: no layer
    assert cut_stages(_block("Block") + head, 2) == [0] * 7 + [1] * 6  # before: 0 0 0 0 1 1 0 1 ...
    assert cut_stages(_block("Block") + _block("Block_1") + head, 2) == [0] * 7 + [1] * 13  # the lighter largest run


def test_sub_layers_are_cut_only_when_the_top_level_has_too_few():
    model = [(("GPT", *path) if path else ("GPT",)) for path in _block("Block") + _block("Block_1")]
    assert cut_stages(model, 2) == [0] * 7 + [1] * 7  # one top-level layer: its blocks are the units
    assert cut_stages(_block("Block"), 4)[:4] == [0, 1, 1, 2]  # one block on 4 stages: its sub-layers


def test_a_layer_called_again_later_does_not_go_back():
    shared = [("Embedding",), ("Block",), ("Block_1",), ("Embedding",), ("Head",)]  # a tied embedding
    assert cut_stages(shared, 2) == [0, 1, 1, 1, 1]  # the second embedding op: stage 1, not back to 0
    assert cut_stages([None, ("A",), None, ("B",), None], 2) == [0, 0, 0, 1, 1]


def test_too_few_layers_are_refused_by_name():
    with pytest.raises(AnnotationError, match=r"stages=3\): the program has 2 layers \(\['/A/', '/A/B/'\]\)"):
        cut_stages([("A",), ("A", "B")], 3)


paths = st.lists(
    st.one_of(st.none(), st.lists(st.sampled_from("abc"), min_size=1, max_size=3).map(tuple)), min_size=1, max_size=30
)


@given(paths, st.integers(2, 4))
def test_every_cut_is_one_contiguous_run_per_stage(ops, stages):
    try:
        stage_of = cut_stages(ops, stages)
    except AnnotationError:
        return
    assert stage_of == sorted(stage_of) and set(stage_of) == set(range(stages))


def _one_block_and_a_head():
    import paddle
    import paddle.nn.functional as F

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 5

    class Block(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.ln, self.up, self.down = paddle.nn.LayerNorm(8), paddle.nn.Linear(8, 16), paddle.nn.Linear(16, 8)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(self.ln(x))))

    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 3, 8], "float32")
        y = paddle.static.data("y", [4, 3, 1], "int64")
        logits = paddle.nn.Linear(8, 5)(paddle.nn.LayerNorm(8)(Block()(x)))
        loss = paddle.mean(F.cross_entropy(logits, y))
        paddle.optimizer.SGD(0.1).minimize(loss)
    return main, startup, loss


def test_one_residual_block_and_a_head_on_two_stages_run_1f1b():
    main, startup, loss = _one_block_and_a_head()
    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    config = autopar.PipelineConfig(stages=2, micro_batches=2, schedule="1F1B")
    dist = autopar.compile(main, mesh, startup_program=startup, strategy=autopar.Strategy(pipeline=config))
    assert len(dist.state.pipeline.stages) == 2
    assert [str(c.kind) for c in dist.comm_ops(0)] == ["send", "recv"]  # the residual stream, its gradient
    rng = np.random.default_rng(0)
    feeds = [
        {"x": rng.standard_normal((4, 3, 8)).astype("float32"), "y": rng.integers(0, 5, (4, 3, 1))} for _ in range(2)
    ]
    serial = run_serial(main, startup, feeds, [loss])
    result = autopar.simulate(dist, feeds, [loss])
    np.testing.assert_allclose([f[0] for f in result.fetches], [f[0] for f in serial.fetches], rtol=1e-5)


def test_the_cut_balances_predicted_time_not_op_counts():
    """Four blocks of the same ops, the first 64x wider (hidden 2048 against 32): by op count the
    cut fell after two blocks (the wide one's stage many times slower); by the cost model's time
    the wide block is a stage of its own. Still equal to serial."""
    import paddle
    import paddle.nn.functional as F

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 7

    class Block(paddle.nn.Layer):
        def __init__(self, hidden):
            super().__init__()
            self.up, self.down = paddle.nn.Linear(32, hidden), paddle.nn.Linear(hidden, 32)

        def forward(self, x):
            return x + self.down(F.relu(self.up(x)))

    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [16, 32], "float32")
        y = paddle.static.data("y", [16, 1], "int64")
        blocks = [Block(hidden) for hidden in (2048, 32, 32, 32)]
        h = x
        for block in blocks:
            h = block(h)
        loss = paddle.mean(F.cross_entropy(paddle.nn.Linear(32, 5)(h), y))
        paddle.optimizer.SGD(0.1).minimize(loss)
    mesh = autopar.ProcessMesh([0, 1], ["pp"])
    config = autopar.PipelineConfig(stages=2, micro_batches=2, schedule="1F1B")
    dist = autopar.compile(main, mesh, startup_program=startup, strategy=autopar.Strategy(pipeline=config))
    on_first = {p.name for p in main.global_block().all_parameters() if 0 in dist.dist_attr(p.name).mesh.ranks}
    assert on_first == {p.name for p in blocks[0].parameters()}, sorted(on_first)  # the wide block only
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((16, 32)).astype("float32"), "y": rng.integers(0, 5, (16, 1))} for _ in range(2)]
    serial = run_serial(main, startup, feeds, [loss])
    result = autopar.simulate(dist, feeds, [loss])
    np.testing.assert_allclose([f[0] for f in result.fetches], [f[0] for f in serial.fetches], rtol=1e-5)
