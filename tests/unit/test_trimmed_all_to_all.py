"""The uneven all_to_all of a dropless buffer (``all_to_all_v`` with ``trim_axis``): what it
puts on the wire (the pieces' shapes, then each other member's piece up to its last row with a
non-zero byte) and what the receiver rebuilds (zero-filled) is all_to_all's result, bit for bit,
for any data; the table names it as all_to_all's uneven form; the native backend refuses it by
name; its price is the routed share of the padded buffer."""

import dataclasses

import numpy as np
import pytest

from autopar.collective import Collective, CollectiveKey, CollectiveKind
from autopar.collective_kinds import kind_of, perform, posted, received, wire_bytes
from autopar.cost_model.moe import uneven_bytes
from autopar.dist_attr import DistAttr
from autopar.errors import CostModelError, NativeUnsupported
from autopar.mesh import ProcessMesh

P = 3
SHAPE = (6, 3, 5, 2)  # [experts, groups, capacity, hidden]: split by expert (0), joined by group (1)


def job(trim_axis=2, **fields):
    whole = DistAttr.replicated(ProcessMesh(list(range(P)), ["ep"]), len(SHAPE))
    return Collective(kind="all_to_all_v", group=tuple(range(P)), key=CollectiveKey("test", 0), value="buffer", src=whole,
                      dst=whole, shape=SHAPE, output_shape=(2, 9, 5, 2), bytes=0, time=0.0, reason="dispatch",
                      axis=1, split_axis=0, trim_axis=trim_axis, **fields)  # fmt: skip


def _inputs(seed):
    rng = np.random.default_rng(seed)
    inputs = {}
    for r in range(P):
        x = rng.standard_normal(SHAPE).astype(np.float32)
        for e in range(SHAPE[0]):  # each expert's slots filled as a prefix, the rest zero
            x[e, :, rng.integers(0, SHAPE[2] + 1) :, :] = 0.0
        inputs[r] = x
    return inputs


def _over_the_wire(collective, inputs):
    messages = {r: posted(collective, inputs[r], r) for r in range(P)}
    return messages, {r: received(collective, messages, inputs[r], r) for r in range(P)}


@pytest.mark.parametrize("seed", range(4))
def test_trimmed_pieces_rebuild_all_to_alls_result_bit_for_bit(seed):
    inputs = _inputs(seed)
    inputs[1][0, 0, 4, 1] = -0.0  # a negative zero in the last row: its bytes are not zero, it is sent
    inputs[2][3, 2, 4, 0] = np.nan
    expected = perform(job(None), inputs)
    _, outputs = _over_the_wire(job(), inputs)
    for r in range(P):
        assert outputs[r].tobytes() == expected[r].tobytes()
    assert np.signbit(outputs[0][0, 3, 4, 1])  # member 1's -0.0 arrived as -0.0 (its piece for member 0)


@pytest.mark.parametrize("seed", range(24))
def test_random_shapes_axes_and_dtypes_rebuild_all_to_alls_result(seed):
    """Random group sizes, ranks, split / join / trim dims and dtypes (bfloat16 as its uint16
    bits), rows zeroed at random (not only a prefix): bit-equal to all_to_all, never more bytes
    on the wire than the padded pieces and the counts."""
    rng = np.random.default_rng(100 + seed)
    p, ndim = int(rng.integers(1, 5)), int(rng.integers(2, 5))
    split_axis, axis = (int(d) for d in rng.permutation(ndim)[:2])
    trim_axis = int(rng.integers(0, ndim)) if seed % 4 else None  # any dim: the split or the joined one too
    shape = [int(rng.integers(1, 4)) for _ in range(ndim)]
    shape[split_axis] *= p
    dtype = rng.choice(["float32", "float64", "uint16", "int64"])
    whole = DistAttr.replicated(ProcessMesh(list(range(p)), ["ep"]), ndim)
    collective = Collective(kind="all_to_all_v", group=tuple(range(p)), key=CollectiveKey("test", 0), value="v", src=whole, dst=whole,
                            shape=tuple(shape), output_shape=tuple(shape), bytes=0, time=0.0, reason="r", axis=axis,
                            split_axis=split_axis, trim_axis=trim_axis)  # fmt: skip
    inputs = {}
    for r in range(p):
        x = (rng.standard_normal(shape) * 1000).astype(dtype)
        x[rng.random(shape) < 0.5] = 0
        inputs[r] = x
    expected = perform(dataclasses.replace(collective, trim_axis=None), inputs)
    messages = {r: posted(collective, inputs[r], r) for r in range(p)}
    outputs = {r: received(collective, messages, inputs[r], r) for r in range(p)}
    for r in range(p):
        assert outputs[r].dtype == expected[r].dtype and outputs[r].tobytes() == expected[r].tobytes()
        if trim_axis is not None:
            slabs = int(np.prod(shape[:trim_axis])) // (p if split_axis < trim_axis else 1)  # (a piece's)
            bound = wire_bytes(dataclasses.replace(collective, trim_axis=None), inputs[r], r) + 8 * (p * ndim + (p - 1) * slabs)
            assert wire_bytes(collective, messages[r], r) <= bound


def test_only_each_slabs_filled_rows_and_the_counts_go_out():
    inputs = {r: np.zeros(SHAPE, np.float32) for r in range(P)}
    inputs[0][2, 0, :2, :] = 1.0  # member 0's piece for member 1 (experts 2, 3): expert 2 of group 0 fills 2 slots,
    inputs[0][3, 1, :4, :] = 1.0  # expert 3 of group 1 fills 4, the other 4 slabs none
    messages, outputs = _over_the_wire(job(), inputs)
    shapes = P * len(SHAPE) * 8  # the pieces' shapes, int64
    counts = 2 * (2 * 3) * 8  # per piece for another member, a count per slab (2 experts x 3 groups), int64
    row = 2 * 4  # a row along the capacity: 2 hidden values, float32
    assert wire_bytes(job(), messages[0], 0) == shapes + counts + (2 + 4) * row
    assert wire_bytes(job(), messages[1], 1) == shapes + counts  # all zero: the counts only
    assert wire_bytes(job(None), inputs[0], 0) == 2 * (2 * 3 * 5) * row  # padded: every slot of the other members' pieces
    assert np.array_equal(outputs[1], perform(job(None), inputs)[1])


def test_the_table_sends_all_to_all_uneven_as_all_to_all_v():
    assert kind_of("all_to_all").sent_uneven_as is CollectiveKind.ALL_TO_ALL_V
    assert all(kind_of(k).sent_uneven_as is None for k in CollectiveKind if k is not CollectiveKind.ALL_TO_ALL)


def test_a_trim_axis_needs_even_pieces():
    with pytest.raises(ValueError, match=r"trim_axis=2 needs even pieces \(no splits\)"):
        job(splits=((2, 2, 2),) * 3)


def test_the_native_backend_refuses_it_by_name():
    with pytest.raises(NativeUnsupported, match="all_to_all_v of buffer .*use the host backend.*uneven_all_to_all=False"):
        kind_of("all_to_all_v").native_op(job(), None, 0, 0)


def test_its_price_is_the_routed_share_of_the_padded_buffer():
    assert uneven_bytes(8192, 0.5) == 4096
    assert uneven_bytes(8192, 0.5, imbalance=1.5) == 6144
    assert uneven_bytes(8192, 0.5, imbalance=4.0) == 8192  # never more than the padded buffer
    assert uneven_bytes(8192, None) == 8192  # the share unknown: priced padded
    with pytest.raises(CostModelError, match="imbalance"):
        uneven_bytes(8192, 0.5, imbalance=0.5)
