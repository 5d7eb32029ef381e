"""Compute costs: FLOPs and memory traffic per op, roofline time (stage: cost report, choices).

:func:`op_cost` prices one op on given (local) shapes: ``flops`` counts multiply and add as
two, ``bytes`` is every input read once plus every output written once. :meth:`OpCost.time`
is the roofline ``max(flops / matmul rate[dtype], bytes / streamed bandwidth)`` on a cluster's
device, at the rates it achieves (measured; the peaks where none was; a batched matmul —
attention's products — at the device's batched rate), and no less than the
op's elements times its kernel's measured seconds per element where the device measured it
(CPU kernels that compute per element or reduce run far below the streamed bandwidth). Covered: the ops with
SPMD rules — matmul, conv2d, elementwise and activations, reductions, softmax, layer_norm, embedding, optimizer updates (sgd, momentum, adam, adamw) —
and their grad ops (matmul / conv grads cost twice the forward FLOPs: one product per input
gradient; other grads once). Shapes are per rank: pass ``DistAttr.local_shape(...)`` to
price a shard. An op outside the table raises :class:`CostModelError` naming it.

Mixed precision: ``dtype`` is the dtype the op computes in (its matmul rate: a bfloat16 GEMM on
h100-node at 710 TFLOP/s, a float32 one at 50.6; :func:`compute_dtype` reads it off the
operands), ``dtypes`` each operand's own (a ``cast`` from float32 to bfloat16 reads 4 bytes an
element and writes 2; an O2 ``sgd_`` reads a bfloat16 gradient and a float32 master).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.cost_model.cluster import Cluster, dtype_bytes
from autopar.errors import CostModelError
from autopar.spmd import trait_values

Shape = Sequence[int]

ELEMENTWISE = trait_values("flops_per_element")  # FLOPs per output element, declared beside the ops' rules
REDUCTIONS = ("sum", "mean", "max", "min", "reduce_sum", "reduce_mean", "prod")
OPTIMIZERS = trait_values("optimizer_cost")  # {"adam": (FLOPs per element, states), ...}, declared beside the rules


@dataclass(frozen=True, slots=True)
class OpCost:
    """FLOPs and bytes of memory traffic of one op on one rank; ``kernel`` (the op's base name)
    and ``elements`` (of its largest operand) for a device that measured its kernels."""

    flops: float
    bytes: float
    kernel: str = ""
    elements: float = 0.0
    batched: bool = False  # a batched matmul (attention's products): the device's batched rate

    def time(self, cluster: Cluster, dtype: str = "float32") -> float:
        """Roofline seconds on ``cluster``'s device, at the rates its ops achieve
        (:class:`~autopar.cost_model.cluster.Device`: measured matmul FLOP/s, streamed bytes/s),
        and at least the kernel's measured seconds per element where the device has them
        (a CPU's ``gelu_grad`` computes, its ``add_grad`` reduces, far below the streamed
        bandwidth); without the fixed cost per op (``device.op_seconds``)."""
        device = cluster.device
        rate = device.matmul_rate(dtype, self.batched)
        roofline = max(self.flops / rate, self.bytes / device.stream_bandwidth(self.bytes))
        return max(roofline, self.elements * device.element_seconds(self.kernel))


def _numel(shape: Shape) -> int:
    return math.prod(int(s) for s in shape)


def _traffic(inputs: Sequence[Shape], outputs: Sequence[Shape], itemsizes: Sequence[int]) -> float:
    """Bytes of every operand read or written once (``itemsizes``: inputs' then outputs')."""
    return float(sum(_numel(s) * size for s, size in zip([*inputs, *outputs], itemsizes)))


def _itemsizes(count: int, dtype: str, dtypes: Sequence[str] | None) -> list[int]:
    """Bytes per element of each of ``count`` operands: ``dtypes``' own, else ``dtype``'s."""
    if dtypes is None:
        return [dtype_bytes(dtype)] * count
    if len(dtypes) != count:
        raise CostModelError(f"{len(dtypes)} operand dtypes given for {count} operands: {list(dtypes)}")
    return [dtype_bytes(d) for d in dtypes]


FLOATING = ("float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


def compute_dtype(input_dtypes: Sequence[str], output_dtypes: Sequence[str] = ()) -> str:
    """The dtype an op computes in: its first floating-point input's (a bfloat16 matmul of an
    AMP program; a ``cast`` to bfloat16 reads float32), else its first floating-point output's,
    else float32."""
    for dtype in [*input_dtypes, *output_dtypes]:
        name = str(dtype).removeprefix("paddle.")
        if name in FLOATING:
            return name
    return "float32"


def is_batched(x: Shape, y: Shape) -> bool:
    """Whether a matmul of ``x`` by ``y`` is batched: ``y`` is no weight (it has batch dims of
    more than one element), as attention's ``q @ k^T`` and ``p @ v``; a GEMM of activations by
    a 2-D weight is not."""
    return len(x) > 2 and len(y) > 2 and _numel(y[:-2]) > 1


def base_name(op_name: str) -> str:
    """``pd_op.matmul_grad`` -> ``matmul_grad``; in-place ``adam_`` -> ``adam``."""
    name = op_name.split(".")[-1]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def matmul_flops(x: Shape, y: Shape, attrs: Mapping[str, Any] | None = None) -> float:
    """``2 * batch * m * k * n`` (``transpose_x`` / ``transpose_y`` honoured, batch dims broadcast)."""
    attrs = attrs or {}
    x, y = list(x), list(y)
    if len(x) == 1:
        x = [1, *x]
    if len(y) == 1:
        y = [*y, 1]
    m, k = (x[-1], x[-2]) if attrs.get("transpose_x") else (x[-2], x[-1])
    k2, n = (y[-1], y[-2]) if attrs.get("transpose_y") else (y[-2], y[-1])
    if k != k2:
        raise CostModelError(f"matmul: contracted sizes differ ({k} vs {k2}) for shapes {list(x)} x {list(y)}")
    batch = [max(a, b) for a, b in _align(x[:-2], y[:-2])]
    return 2.0 * _numel(batch) * m * k * n


def _align(a: list[int], b: list[int]) -> list[tuple[int, int]]:
    width = max(len(a), len(b))
    return list(zip([1] * (width - len(a)) + a, [1] * (width - len(b)) + b))


def conv2d_flops(x: Shape, w: Shape, out: Shape) -> float:
    """``2 * N * O * Ho * Wo * (C / groups) * kh * kw`` (NCHW input, OIHW filter)."""
    n, o = out[0], out[1]
    return 2.0 * n * o * _numel(out[2:]) * _numel(w[1:])


def op_cost(
    op_name: str,
    inputs: Sequence[Shape],
    outputs: Sequence[Shape],
    attrs: Mapping[str, Any] | None = None,
    dtype: str = "float32",
    dtypes: Sequence[str] | None = None,
) -> OpCost:
    """FLOPs and bytes of ``op_name`` (Paddle name, ``pd_op.`` prefix optional) on these shapes;
    ``dtypes``: each operand's dtype, inputs' then outputs' (default: ``dtype`` for all)."""
    cost = _op_cost(op_name, inputs, outputs, attrs, _itemsizes(len(inputs) + len(outputs), dtype, dtypes))
    return OpCost(cost.flops, cost.bytes, base_name(op_name), _largest(inputs, outputs), cost.batched)


def _largest(inputs: Sequence[Shape], outputs: Sequence[Shape]) -> float:
    """Elements of the largest operand (what a measured kernel's seconds per element count)."""
    return float(max(map(_numel, [*inputs, *outputs]), default=0))


def _op_cost(
    op_name: str, inputs: Sequence[Shape], outputs: Sequence[Shape], attrs: Mapping[str, Any] | None, itemsizes: list[int]
) -> OpCost:  # fmt: skip
    name = base_name(op_name)
    grad = name.endswith("_grad")
    fwd = name.removesuffix("_grad")
    traffic = _traffic(inputs, outputs, itemsizes)
    out_elems = sum(_numel(s) for s in outputs)
    if fwd == "matmul":
        flops = matmul_flops(inputs[0], inputs[1], attrs)
        return OpCost(flops * (2 if grad else 1), traffic, batched=is_batched(inputs[0], inputs[1]))
    if fwd in ("conv2d", "depthwise_conv2d"):
        flops = conv2d_flops(inputs[0], inputs[1], inputs[-1] if grad else outputs[0])
        return OpCost(flops * (2 if grad else 1), traffic)
    if fwd in ELEMENTWISE:
        return OpCost(float(ELEMENTWISE[fwd] * out_elems), traffic)
    if fwd in REDUCTIONS:
        return OpCost(float(_numel(inputs[0])), traffic)
    if fwd in ("softmax", "log_softmax", "cross_entropy_with_softmax"):
        return OpCost(5.0 * _numel(inputs[0]), traffic)
    if fwd == "layer_norm":
        return OpCost(8.0 * _numel(inputs[0]), traffic)
    if fwd == "embedding":
        return OpCost(float(out_elems if grad else 0), float(sum(map(_numel, outputs)) * 2 * itemsizes[-1]))
    if fwd in OPTIMIZERS:
        per_elem, _ = OPTIMIZERS[fwd]
        return OpCost(float(per_elem * _numel(inputs[0])), traffic)
    raise CostModelError(f"no compute cost for op {op_name!r}; known: matmul, conv2d, {', '.join(sorted(ELEMENTWISE))}, "
                         f"{', '.join(REDUCTIONS)}, softmax, layer_norm, embedding, {', '.join(OPTIMIZERS)} (and _grad)")  # fmt: skip


def einsum_cost(
    equation: str, sizes: Mapping[str, int], dtype: str = "float32", splits: Mapping[str, int] | None = None
) -> OpCost:
    """Cost of an op described by an einsum-like equation (``"mk,kn->mn"``) on one rank.

    ``sizes``: global size per letter; ``splits``: parts each letter is split into (the
    product of its mesh dims' sizes). A contraction (a letter missing from every output)
    costs ``2 * prod(all letters)``; otherwise one FLOP per output element.
    """
    splits = splits or {}
    lhs, rhs = equation.split("->")
    local = {c: math.ceil(sizes[c] / splits.get(c, 1)) for c in sizes}
    letters = {c for c in lhs + rhs if c.isalpha()}
    outs = rhs.split(",")
    contracted = {c for c in letters if all(c not in o for o in outs)}

    def elems(term: str) -> int:
        return math.prod(local.get(c, 1) for c in term if c.isalpha())

    if contracted:
        flops = 2.0 * math.prod(local.get(c, 1) for c in letters)
    else:
        flops = float(sum(elems(o) for o in outs))
    traffic = sum(elems(t) for t in [*lhs.split(","), *outs]) * dtype_bytes(dtype)
    return OpCost(flops, float(traffic))


def op_cost_or_traffic(
    op_name: str, inputs: Sequence[Shape], outputs: Sequence[Shape], attrs: Mapping[str, Any] | None = None, dtype: str = "float32",
    dtypes: Sequence[str] | None = None,
) -> tuple[OpCost, bool]:  # fmt: skip
    """:func:`op_cost`, and True; for an op the table lacks (or an odd dtype or shape), its
    memory traffic alone — every operand read and result written once, in its dtype — and
    False: a shape, index or copy op is memory-bound, and pricing it so beats leaving it free."""
    try:
        return op_cost(op_name, inputs, outputs, attrs, dtype, dtypes), True
    except (CostModelError, IndexError, KeyError, ValueError):
        count = len(inputs) + len(outputs)
        try:
            itemsizes = _itemsizes(count, dtype, dtypes)
        except CostModelError:
            itemsizes = [4] * count
        return OpCost(0.0, _traffic(inputs, outputs, itemsizes), base_name(op_name), _largest(inputs, outputs)), False
