"""autopar/low_precision.py and the collective kinds' low-precision reductions: bfloat16 values
move as their uint16 bits and are summed member by member in group order, each addition in
float32 rounded to bfloat16 (what a ring's per-hop reduction computes), on every path the
backends take (``perform``, ``perform_for``, ``perform_into``, the emulation)."""

from __future__ import annotations

import numpy as np
import pytest

from autopar.collective import Collective, CollectiveKey, CollectiveKind
from autopar.collective_kinds import KINDS, emulated, perform, perform_for
from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.low_precision import narrow, reduce, widen
from autopar.mesh import ProcessMesh


def _job(kind, group, shape, dtype="bfloat16", reduce_op="sum", axis=0):
    attr = DistAttr.replicated(ProcessMesh(list(group)), len(shape))
    return Collective(
        kind=kind, group=tuple(group), key=CollectiveKey("test", 0), value="g", src=attr, dst=attr, shape=shape,
        output_shape=shape, bytes=0, time=0.0, reason="test", reduce=reduce_op, axis=axis, dtype=dtype,
    )  # fmt: skip


def _bf16(values) -> np.ndarray:
    return narrow(np.asarray(values, np.float32), "bfloat16")


def _paddle_cast_bits(values: np.ndarray) -> np.ndarray:
    """Paddle's own fp32 -> bf16 cast of ``values`` (a static program on CPU), as bits."""
    import paddle

    paddle.enable_static()
    main = paddle.static.Program()
    with paddle.static.program_guard(main):
        x = paddle.static.data("x", list(values.shape), "float32")
        low = paddle._C_ops.cast(x, paddle.bfloat16)
    (out,) = paddle.static.Executor(paddle.CPUPlace()).run(main, feed={"x": values}, fetch_list=[low])
    return np.asarray(out)


def test_rounding_to_bfloat16_is_paddles_cast_bit_for_bit():
    """Ties to even (1 + 2^-8 down, 1 + 3·2^-8 up), above a tie, below one, overflow to inf,
    inf, NaN, subnormals, signs, and random values at every scale."""
    special = [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, 1 - 1.5 * 2**-9, 3.4e38, -3.4e38, np.inf, -np.inf, np.nan,
               1e-40, -1e-40, 0.0, -0.0]  # fmt: skip
    rng = np.random.default_rng(0)
    values = np.concatenate([np.array(special, np.float32), (rng.standard_normal(4000) * 10.0 ** rng.integers(-30, 30, 4000)).astype(np.float32)])
    got = narrow(values, "bfloat16")
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(got, _paddle_cast_bits(values))
    finite = np.isfinite(widen(got, "bfloat16"))
    np.testing.assert_array_equal(narrow(widen(got, "bfloat16"), "bfloat16")[finite], got[finite])  # exact both ways


def test_a_bfloat16_sum_rounds_each_hop_in_group_order():
    """1 + 2^-8 is a tie that rounds to 1, so 1 then 2^-8 then 2^-8 stays 1 (0x3F80); the same
    members the other way round make 2^-7 first, exact, then 1 + 2^-7 (0x3F81). Neither is the
    bits added as integers, nor (the first) one rounding of the float32 sum."""
    one, small = _bf16([1.0]), _bf16([2**-8])
    assert reduce([one, small, small], "sum", "bfloat16").tolist() == [0x3F80]
    assert reduce([small, small, one], "sum", "bfloat16").tolist() == [0x3F81]
    job = _job(CollectiveKind.ALL_REDUCE, (0, 1, 2), (1,))
    outs = perform(job, {0: one, 1: small, 2: small})
    assert all(out.dtype == np.uint16 and out.tolist() == [0x3F80] for out in outs.values())
    assert perform(job, {0: small, 1: small, 2: one})[0].tolist() == [0x3F81]


@pytest.mark.parametrize("reduce_op", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize("members", [2, 3, 4])
def test_every_path_to_a_bfloat16_reduction_is_bit_equal(reduce_op, members):
    """``perform`` (the simulator), ``perform_for`` (a rank computing its own output: gloo's
    sub-group exchange, shared memory), ``perform_into`` (shared memory's in-place path) and
    the reduce_scatter's emulation by an all_reduce (gloo over the world) give the same bits, and
    they are the rule: widened, combined one by one in float32, each rounded."""
    rng = np.random.default_rng(members)
    group = tuple(range(members))
    arrays = {r: _bf16(rng.standard_normal((6, 5)) * 3) for r in group}
    job = _job(CollectiveKind.ALL_REDUCE, group, (6, 5), reduce_op=reduce_op)
    want = arrays[0]
    combine = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}[reduce_op]
    for r in group[1:]:
        want = narrow(combine(widen(want, "bfloat16"), widen(arrays[r], "bfloat16")), "bfloat16")
    if reduce_op == "avg":
        want = narrow(widen(want, "bfloat16") / np.float32(members), "bfloat16")
    outs = perform(job, arrays)
    for r in group:
        np.testing.assert_array_equal(outs[r], want)
        np.testing.assert_array_equal(perform_for(job, arrays, r), want)
    out = np.empty((6, 5), np.uint16)
    assert KINDS[job.kind].perform_into(job, out, arrays)
    np.testing.assert_array_equal(out, want)
    scatter = _job(CollectiveKind.REDUCE_SCATTER, group, (6, 5), reduce_op=reduce_op)
    pieces = perform(scatter, arrays)
    for r in group:
        np.testing.assert_array_equal(pieces[r], perform_for(scatter, arrays, r))
        np.testing.assert_array_equal(pieces[r], emulated(scatter, r, lambda em, r=r: perform(em, arrays)[r]))
    np.testing.assert_array_equal(np.concatenate([pieces[r] for r in group]), want)


def test_moving_kinds_move_the_bits_unchanged():
    rng = np.random.default_rng(3)
    arrays = {r: _bf16(rng.standard_normal((2, 3))) for r in (0, 1)}
    gathered = perform(_job(CollectiveKind.ALL_GATHER, (0, 1), (4, 3)), arrays)
    np.testing.assert_array_equal(gathered[1], np.concatenate([arrays[0], arrays[1]]))
    assert gathered[1].dtype == np.uint16
    broadcast = perform(_job(CollectiveKind.BROADCAST, (0, 1), (2, 3)), arrays)
    np.testing.assert_array_equal(broadcast[1], arrays[0])


def test_bits_under_a_float32_collective_or_floats_under_a_bfloat16_one_are_refused():
    """A uint16 array reduced as float32 would add the bit patterns: refused, naming the dtypes."""
    bits = {r: _bf16([1.0, 2.0]) for r in (0, 1)}
    with pytest.raises(AutoparError, match="float32 reduction got uint16 arrays"):
        perform(_job(CollectiveKind.ALL_REDUCE, (0, 1), (2,), dtype="float32"), bits)
    floats = {r: np.ones(2, np.float32) for r in (0, 1)}
    with pytest.raises(AutoparError, match=r"bfloat16 reduction holds its values as uint16 arrays; got \['float32'\]"):
        perform(_job(CollectiveKind.ALL_REDUCE, (0, 1), (2,)), floats)


def test_a_bfloat16_scope_tensor_is_viewed_as_its_bits_and_written_back_as_bfloat16():
    """Shared memory reads a bf16 scope tensor in place (its uint16 bits) and writes results
    through the view; a result set into a tensor from its bits is a bfloat16 tensor."""
    import paddle
    from paddle.base import core

    from autopar.runtime import shm

    tensor = core.DenseTensor()
    tensor.set(_bf16([1.0, -2.5, 3.0]), paddle.CPUPlace())
    assert str(tensor._dtype()) == "paddle.bfloat16"
    view = shm.tensor_view(tensor)
    assert view.dtype == np.uint16 and view.tolist() == _bf16([1.0, -2.5, 3.0]).tolist()
    view[...] = reduce([view, _bf16([1.0, 0.5, 0.25])], "sum", "bfloat16")
    assert str(tensor._dtype()) == "paddle.bfloat16"
    np.testing.assert_array_equal(widen(np.array(tensor), "bfloat16"), [2.0, -2.0, 3.25])


def test_float16_follows_the_same_rule_in_numpys_own_dtype():
    """float16 is held as numpy's float16; its sum is the same member-by-member float32 addition
    rounded each time (here 2048 + 1 is a tie that rounds to 2048, twice: one rounding of the
    float32 sum, 2050, would differ)."""
    members = [np.array([2048.0], np.float16), np.array([1.0], np.float16), np.array([1.0], np.float16)]
    job = _job(CollectiveKind.ALL_REDUCE, (0, 1, 2), (1,), dtype="float16")
    out = perform(job, dict(enumerate(members)))[0]
    assert out.dtype == np.float16 and out.tolist() == [2048.0]
    assert perform(job, {0: members[1], 1: members[2], 2: members[0]})[0].tolist() == [2050.0]


# ---- between processes: shared memory (forked, no Paddle started in them) ------------------

# (kind, group by rank on a 2 x 2 mesh, shape): world sums of 4 members (order matters),
# a dp-group reduce_scatter, a gather of bits
BETWEEN = [
    (CollectiveKind.ALL_REDUCE, lambda r: (0, 1, 2, 3), (40, 3)),
    (CollectiveKind.REDUCE_SCATTER, lambda r: (r % 2, r % 2 + 2), (6, 2)),
    (CollectiveKind.ALL_GATHER, lambda r: (0, 1) if r < 2 else (2, 3), (2, 5)),
    (CollectiveKind.ALL_REDUCE, lambda r: (0, 1, 2, 3), ()),
]


def _between_inputs(step, rank, shape):
    rng = np.random.default_rng(100 * step + rank)
    return _bf16(rng.standard_normal(shape) * 10.0 ** rng.integers(-2, 3, shape))


def _shm_rank(rank, shared, results):
    """What SharedMemoryCommunicator.run does for each job: post the bits, this rank's output
    by the kind table from every member's bits."""
    import traceback

    from test_shared_memory_comm import _Store

    from autopar.runtime import shm

    try:
        node = shm.NodeMemory(rank, 4, _Store(shared), 20.0)
        outs = []
        for step, (kind, groups, shape) in enumerate(BETWEEN):
            job = _job(kind, groups(rank), shape)
            x = _between_inputs(step, rank, shape)
            outs.append(node.collect(job.group, x, lambda a, job=job: shm._owned(perform_for(job, a, rank), a)))
        results[rank] = ("ok", outs)
        node.close()
    except BaseException as error:  # reported to the test
        results[rank] = ("error", f"{type(error).__name__}: {error}", traceback.format_exc())


def test_shared_memory_between_processes_gives_the_simulators_bits():
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    manager = fork.Manager()
    shared, results = manager.dict(), manager.dict()
    procs = [fork.Process(target=_shm_rank, args=(r, shared, results)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    results = dict(results)
    assert sorted(results) == [0, 1, 2, 3] and all(res[0] == "ok" for res in results.values()), results
    for step, (kind, groups, shape) in enumerate(BETWEEN):
        for rank in range(4):
            job = _job(kind, groups(rank), shape)
            want = perform(job, {r: _between_inputs(step, r, shape) for r in job.group})[rank]
            got = results[rank][1][step]
            assert got.dtype == np.uint16 and got.shape == want.shape, (step, kind, got.dtype, got.shape)
            np.testing.assert_array_equal(got, want, err_msg=f"step {step} {kind} rank {rank}")


def test_partial_pieces_of_a_bfloat16_value_assemble_by_the_rule():
    """A fetched value the program leaves partial is assembled on the host (the simulator, the
    Executor's exchange): its bfloat16 pieces summed by the rule, never as bits."""
    from autopar.dist_attr import DistAttr
    from autopar.pieces import assemble

    mesh = ProcessMesh([0, 1, 2], ["mp"])
    partial = DistAttr.of(mesh, ((),), ((0, "sum"),))
    pieces = {0: _bf16([1.0]), 1: _bf16([2**-8]), 2: _bf16([2**-8])}
    assert assemble(pieces, partial, (1,), "bfloat16").tolist() == [0x3F80]
    with pytest.raises(AutoparError, match=r"uint16 \(bfloat16 bits\) reduced as float32"):
        assemble(pieces, partial, (1,))
