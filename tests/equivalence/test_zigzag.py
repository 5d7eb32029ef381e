"""``ContextParallel(balance="zigzag")``: a fetched per-token value comes back in the serial
order. The program carries the sequence in zig-zag order (rank i: chunks i and 2cp-1-i); the
fetch puts it back from the rank plan's ``ValueInfo.order`` (autopar/zigzag_values.py),
or refuses by name a value whose order is not known."""

import numpy as np
import paddle
import pytest

import autopar
from autopar.rank_plan import SequenceOrder
from autopar.rewrites.zigzag import zigzag_order
from autopar.runtime.simulator import simulate
from autopar.testing.serial import random_feeds, run_serial
from autopar.testing.zoo import gpt2, llama

BATCH, SEQ = 4, 8
CASES = {  # name -> (model module, cp, method)
    "sep2, llama, all_gather": (llama, 2, "all_gather"),
    "sep4, llama, all_to_all": (llama, 4, "all_to_all"),
    "sep2, gpt2, ring": (gpt2, 2, "ring"),
    "sep4, llama, ring": (llama, 4, "ring"),
}


def logits_of(main):
    """The logits ``[batch, seq, vocab]`` and their flattening ``[batch * seq, vocab]`` the loss reads."""
    for op in main.global_block().ops:
        if op.name() == "pd_op.cross_entropy_with_softmax":
            flat = op.operand_source(0)
            return flat.get_defining_op().operand_source(0), flat
    raise AssertionError("no cross_entropy_with_softmax")


@pytest.mark.parametrize("name", list(CASES))
def test_fetched_logits_under_zigzag_equal_serials(name):
    module, cp, method = CASES[name]
    mesh = autopar.ProcessMesh(list(range(cp)), ["sep"])
    seed = module.build(module.Config(), batch=BATCH, seq=SEQ, mesh=mesh)
    logits, flat = logits_of(seed.main)
    strategy = autopar.Strategy(context_parallel=autopar.ContextParallel("sep", method, "zigzag"))
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    order = dist.values.info(dist.key(logits)).order
    assert order is not None and order.dims == ((1, SEQ, 1),) and order.order == zigzag_order(SEQ, cp)  # held permuted
    assert dist.values.info(dist.key(flat)).order.dims == ((0, SEQ, 1),)  # a block of [batch * seq]
    feeds = gpt2.feeds(module.Config(), BATCH, SEQ, 2) if module is gpt2 else random_feeds(seed.feeds, 2, classes=64)
    start = paddle.get_rng_state()
    got = simulate(dist, feeds, [seed.loss, logits, flat])
    paddle.set_rng_state(start)
    want = run_serial(seed.main, seed.startup, feeds, [seed.loss, logits, flat])
    for step, (g, w) in enumerate(zip(got.fetches, want.fetches)):
        for what, a, b in zip(("loss", "logits", "flat logits"), g, w):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"{what}, step {step}")


def test_a_fetch_whose_order_is_not_known_is_refused_by_name_before_the_step(llama_zigzag):
    """A value the walk cannot follow (here: the order of the flattened logits forgotten, as an
    op it does not know would leave it) is refused at fetch, before any step runs."""
    import dataclasses

    seed, dist, feeds = llama_zigzag
    _, flat = logits_of(seed.main)
    key = dist.key(flat)
    info = dist.values.info(key)
    dist.values._infos[key] = dataclasses.replace(info, order=SequenceOrder(info.order.order, (), "an op it does not know"))
    try:
        with pytest.raises(autopar.AutoparError, match=rf"{info.label} carries the sequence in the zig-zag order .* an op it does not know"):
            simulate(dist, feeds, [seed.loss, flat])
    finally:
        dist.values._infos[key] = info


def test_a_sequence_order_puts_blocks_back_and_refuses_an_unknown_one_by_name():
    order = zigzag_order(4, 2)  # (0, 3, 1, 2)
    serial = np.arange(2 * 4 * 3).reshape(2 * 4, 3)  # [batch * seq, hidden]: the sequence a block of dim 0
    held = serial.reshape(2, 4, 3)[:, list(order)].reshape(8, 3)
    np.testing.assert_array_equal(SequenceOrder(order, ((0, 4, 1),)).serial(held, "x"), serial)
    mask = np.arange(36).reshape(6, 6)  # a mask buffer longer than the sequence: the tail in place
    index = [*order, 4, 5]
    np.testing.assert_array_equal(SequenceOrder(order, ((0, 6, 1), (1, 6, 1))).serial(mask[index][:, index], "m"), mask)
    with pytest.raises(autopar.AutoparError, match=r"%7\.0 carries the sequence in the zig-zag order.*dim 1 of"):
        SequenceOrder(order, (), "dim 1 of %3.0 [4, 8], in zig-zag order, has no place").serial(held, "%7.0")


@pytest.fixture(scope="module")
def llama_zigzag():
    """The Llama zoo model, all_gather plan on sep2, zig-zag; one step of random feeds."""
    mesh = autopar.ProcessMesh([0, 1], ["sep"])
    seed = llama.build(llama.Config(), batch=BATCH, seq=SEQ, mesh=mesh)
    strategy = autopar.Strategy(context_parallel=autopar.ContextParallel("sep", "all_gather", "zigzag"))
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    return seed, dist, random_feeds(seed.feeds, 1, classes=64)


def test_check_is_clean_under_zigzag_comparing_in_serial_order(llama_zigzag):
    from autopar.inspect.check import _in_serial_order, _keys

    seed, dist, feeds = llama_zigzag
    report = autopar.check(dist, feeds)
    assert report.clean, str(report)
    keys = _keys(dist)
    in_order = _in_serial_order(dist, keys)
    permuted = [k for k in in_order if dist.values.info(k).order is not None]
    assert len(in_order) > 0.9 * len(keys) and len(permuted) > 100  # compared with your program's, put back


def test_check_names_a_planted_difference_under_zigzag(llama_zigzag):
    from autopar.testing import faults

    seed, dist, feeds = llama_zigzag
    report = autopar.check(faults.FaultyProgram(dist, faults.wrong_piece(lambda c: c.kind.value == "all_gather")), feeds)
    assert not report.clean
    assert report.first.op.startswith("pd_op.matmul#") and any(line.startswith("all_gather") for line in report.first.collectives), str(report)


def test_check_names_a_reordering_that_does_not_follow_the_sequence(monkeypatch):
    """A zig-zag rewrite that forgot the rotary positions (the arange) runs a program that is
    not yours: the distributed run equals that program, and check, comparing with your
    program in serial order, names where it departs (the rotary angles)."""
    import importlib

    module = importlib.import_module("autopar.rewrites.zigzag")

    targets = module._targets
    monkeypatch.setattr(module, "_targets", lambda graph, length, feeds: {
        k: d for k, d in targets(graph, length, feeds).items() if graph.ops[k[0]].short_name != "arange"
    })  # fmt: skip
    monkeypatch.setattr(module, "_refuse_unfollowed", lambda *args: None)
    mesh = autopar.ProcessMesh([0, 1], ["sep"])
    seed = llama.build(llama.Config(), batch=BATCH, seq=SEQ, mesh=mesh)
    strategy = autopar.Strategy(context_parallel=autopar.ContextParallel("sep", "all_gather", "zigzag"))
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    report = autopar.check(dist, random_feeds(seed.feeds, 1, classes=64))
    assert not report.clean
    assert report.first.op.startswith("pd_op.multiply#") and report.first.layer.endswith("Attention"), str(report)  # q * cos


DROPOUT = {  # name -> (mesh, method, other Strategy fields)
    "sep2, ring": (autopar.ProcessMesh([0, 1], ["sep"]), "ring", {}),
    "sep2, all_to_all": (autopar.ProcessMesh([0, 1], ["sep"]), "all_to_all", {}),
    "sep4, all_gather": (autopar.ProcessMesh([0, 1, 2, 3], ["sep"]), "all_gather", {}),
    "sep4, ring": (autopar.ProcessMesh([0, 1, 2, 3], ["sep"]), "ring", {}),
    "pp2 x sep2 1F1B m=2, ring": (autopar.ProcessMesh([[0, 1], [2, 3]], ["pp", "sep"]), "ring", {"pipeline": autopar.PipelineConfig(micro_batches=2)}),
    "dp2 x sep2 recompute, all_to_all": (autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "sep"]), "all_to_all", {"recompute": True}),
}


@pytest.mark.parametrize("name", list(DROPOUT))
def test_gpt2_with_dropout_under_zigzag_equals_serial(name):
    """Each dropout draws the serial mask and reorders it like the values it multiplies
    (attention probabilities on both sequence dims, activations on dim 1; the ring's blocks
    cut from the reordered mask): the elements serial drops. Drawn in zig-zag order instead,
    the losses differ at the first step."""
    from autopar.testing.serial import assert_simulation_equals_serial

    mesh, method, fields = DROPOUT[name]
    config = gpt2.Config(dropout=0.1)
    seed = gpt2.build(config, batch=BATCH, seq=SEQ, mesh=mesh)
    strategy = autopar.Strategy(context_parallel=autopar.ContextParallel("sep", method, "zigzag"), **fields)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    orders = [dist.values.info(op.inputs[0]).order for op in dist.graph.ops if op.short_name == "dropout"]
    assert {o.dims for o in orders} >= {((1, SEQ, 1),), ((2, SEQ, 1), (3, SEQ, 1))}  # activations, probabilities
    assert_simulation_equals_serial(seed, dist, classes=64, feeds=gpt2.feeds(config, BATCH, SEQ, 3))
    if name == "sep2, ring":
        report = autopar.check(dist, gpt2.feeds(config, BATCH, SEQ, 1))
        assert report.clean, str(report)


def along_program(along):
    """x [4, 8, 16] -> linear -> ``along`` (an op working along the sequence) -> mean."""
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, SEQ, 16], "float32")
        h = paddle.nn.Linear(16, 16)(x)
        paddle.optimizer.SGD(0.1).minimize(along(h).mean() * h.mean())
    return main, startup


@pytest.mark.parametrize(("along", "op"), [
    (lambda h: paddle.flip(h, axis=[1]), "pd_op.flip"),
    (lambda h: paddle.cumsum(h, axis=1), "pd_op.cumsum"),
    (lambda h: h[:, 1:] * h[:, :-1], "pd_op.slice"),  # a shift (next-token labels)
])  # fmt: skip
def test_an_op_working_along_the_reordered_sequence_is_refused_by_name(along, op):
    main, startup = along_program(along)
    mesh = autopar.ProcessMesh([0, 1], ["sep"])
    strategy = autopar.Strategy(context_parallel=autopar.ContextParallel("sep", "all_gather", "zigzag"))
    with pytest.raises(autopar.AutoparError, match=rf"balance='zigzag'\) over 'sep': {op}#\d+ works along dim 1 of %\d+\.0 \[4, 8, 16\]"):
        autopar.compile(main, mesh, startup_program=startup, strategy=strategy)
