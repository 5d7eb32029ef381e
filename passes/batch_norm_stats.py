"""Batch norm over a split batch with global statistics, equal to serial (stage: comm-inserted
-> statistics-rewritten; the emitter of the lowering :data:`~autopar.spmd.batch_norm.BATCH_STATISTICS`
the batch_norm rules declare, run by :mod:`autopar.passes.op_lowering`).

The rules of :mod:`autopar.spmd.batch_norm` keep x's batch (and spatial) split through
``batch_norm`` / ``batch_norm_`` / ``batch_norm_grad``; Paddle's kernel would normalize each
rank's rows with that rank's statistics. Each such op
(:func:`~autopar.spmd.batch_norm.split_statistics`) is replaced, per rank, by Paddle ops
computing what that rank must compute; ``b(v)`` broadcasts a per-channel vector over x, N is
the whole batch's count per channel, sums run over x's statistic dims:

    forward   d = x - b(running_mean)                      (a shift every rank shares)
              [s1, s2] = all_reduce_sum(stack(sum d, sum d²))          2·C values
              mean = running_mean + s1/N;  var = max(s2/N - (s1/N)², 0)   (biased, as the kernel)
              inv_std = rsqrt(var + eps);  out = (x - b(mean))·b(inv_std·scale) + b(bias)
              mean_out = running_mean·momentum + mean·(1 - momentum)   (variance_out likewise)
              saved_mean = mean, saved_variance = inv_std              (the kernel's forms)
    backward  x̂ = (x - b(saved_mean))·b(saved_variance)
              [Σdy, Σdy·x̂] = all_reduce_sum(stack(sum dy, sum dy·x̂))    2·C values
              bias_grad = Σdy;  scale_grad = Σdy·x̂
              x_grad = b(scale·inv_std)·(dy - b(Σdy/N) - x̂·b(Σdy·x̂/N))

The in-place ``batch_norm_`` writes mean_out / variance_out into the running statistics
(``assign_out_``), as the serial op does.

``Strategy(local_batch_norm=True)`` (the ops' ``autopar.local_statistics`` attribute): classic per-rank batch
norm, NOT equal to serial — each rank normalizes its rows with its own statistics, forward and
backward run Paddle's own kernels, scale_grad / bias_grad are partial sums that join the
gradient sync (rules: :data:`~autopar.spmd.batch_norm.LOCAL_STATISTICS`). The running mean /
variance would then differ between replicas; the policy is to **average them over the
data-parallel group**, weighted by each rank's share of the rows: right after each batch_norm,

    [mean_out, variance_out] = all_reduce_sum(stack(mean_out, variance_out) · n_rank / N)    2·C values

written back into the running statistics. Every replica keeps the same running statistics; the
running mean equals serial's exactly (the weighted mean of the ranks' batch means is the
batch mean), the running variance is the mean of the ranks' batch variances (it leaves out how
the ranks' means spread: slightly below serial's). Why averaging rather than rank 0's copy
(PyTorch DDP broadcasts rank 0's buffers before each forward, so its running statistics follow
rank 0's batches only and the others' are thrown away): averaging uses every rank's rows, costs
the same 2·C values per batch norm per step as a broadcast, and is what timm's
``distribute_bn(reduce)`` does at the end of each epoch; the model evaluated afterwards then
sees statistics of the whole data, not of one shard. No statistics all_reduce is added to the
forward's normalization or to the backward. Each all_reduce is planned as the reshard
``P(sum) -> R`` of a ``[2, C]`` tensor and emitted by
:func:`~autopar.passes.reshard_emission.emit_step`, so ``dist.comm_ops(rank)`` lists it and
every backend runs it. Runs after reshard emission (operands final); exact: the serial op is
erased, ``rp.replaced`` holds its results and ``rp.ops`` maps it to the op making the rewrite's
last value; local: the serial op stays, the readers of its running statistics read the averages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from autopar.causes import in_layer, layer_of
from autopar.collective import CollectiveKey
from autopar.cost_model import plan_reshard
from autopar.dist_attr import DistAttr
from autopar.graph import OpNode
from autopar.passes.base import CompileState, RankProgram
from autopar.passes.reshard_emission import emit_step, replace_uses
from autopar.spmd.batch_norm import SplitStatistics


@dataclass(frozen=True, slots=True)
class StatValue:
    """The per-channel sums an all_reduce moves (what emit_step reads of a serial value)."""

    label: str
    shape: tuple[int, ...]
    dtype: str


def rewrite(state: CompileState, rp: RankProgram, op: OpNode, split: SplitStatistics) -> None:
    """Replace ``op`` in ``rp`` by its global-statistics form, or (local statistics) average its running
    statistics after it (the emitter of :data:`~autopar.spmd.batch_norm.BATCH_STATISTICS`)."""
    import paddle

    serial = rp.ops[op.index]
    operands = [
        serial.operand_source(i) if serial.operand_source(i).initialized() else None
        for i in range(serial.num_operands())
    ]
    kernels = StatKernels(state, rp, op, split)
    if split.local:
        if split.op == "batch_norm":
            kernels.average_running(serial, operands, inplace=op.short_name.endswith("_"))
        return  # (the grad: Paddle's kernel is the per-rank one)
    paddle.pir.set_insertion_point(serial)
    if split.op == "batch_norm":
        results = kernels.forward(*operands, inplace=op.short_name.endswith("_"))
    else:
        results = kernels.backward(*operands)
    for j, new in enumerate(results):
        old = serial.result(j)
        if new is None or not old.initialized():
            continue
        if j != 5:  # reserve_space: a placeholder the rewrite's grad does not read
            new.set_type(old.type())
        replace_uses(old, new)
        rp.replaced[(op.index, j)] = new
    rp.ops[op.index] = kernels.last.get_defining_op()
    serial.erase()


class StatKernels:
    """One batch_norm (grad) op's rewrite on one rank, at the current insertion point."""

    def __init__(self, state: CompileState, rp: RankProgram, op: OpNode, split: SplitStatistics) -> None:
        self.state, self.rp, self.op, self.split = state, rp, op, split
        dist: DistAttr = state.propagation.op_results[op.index].inputs[0]
        value = state.graph.values[op.inputs[0]]
        self.label, self.dtype = value.label, value.dtype
        self.channels = int(value.shape[split.channel])
        self.mesh, self.channel_dims = dist.mesh, dist.mapping[split.channel]
        self.broadcast = [1] * len(value.shape)
        self.broadcast[split.channel] = -1
        self.eps = float(op.attrs.get("epsilon", 1e-5))
        self.momentum = float(op.attrs.get("momentum", 0.9))
        self.last: Any = None

    def b(self, v: Any) -> Any:
        import paddle

        return paddle.reshape(v, self.broadcast)

    def sums(self, a: Any, b: Any, what: str) -> tuple[Any, Any]:
        """``(sum a, sum b)`` over the statistic dims of the whole batch: one all_reduce of 2·C."""
        import paddle

        axes = list(self.split.axes)
        stacked = paddle.stack([paddle.sum(a, axis=axes), paddle.sum(b, axis=axes)])
        return self.all_reduce(stacked, "batch-norm statistics", what, "for the whole batch's statistics")

    def all_reduce(self, stacked: Any, feature: str, what: str, purpose: str, tag: str = "") -> tuple[Any, Any]:
        """The sum of ``stacked`` (``[2, C]``, channels as x's) over the statistic dims' mesh
        dims, as the planned reshard ``P(sum) -> R``; its two rows."""
        import paddle

        shape = (2, self.channels)
        src = DistAttr.of(self.mesh, ((), self.channel_dims), {d: "sum" for d in self.split.mesh_dims})
        dst = DistAttr.of(self.mesh, ((), self.channel_dims))
        plan = plan_reshard(src, dst, shape, self.dtype, self.state.cluster)
        names = "/".join(self.mesh.dim_names[d] for d in self.split.mesh_dims)
        stat = StatValue(f"{self.label}.{tag or what.replace(' ', '_')}", shape, self.dtype)
        reason = (
            f"{in_layer(feature, layer_of(self.state.graph, self.op.index))}: {self.op} normalizes "
            f"{self.label} over rows split over {names}: all_reduce[sum] of the {what} (2·C = {2 * self.channels} "
            f"values) {purpose}"
        )
        for i, step in enumerate(plan.steps):
            stacked = emit_step(
                self.state, self.rp, step, stacked, stat, reason, CollectiveKey("batch_norm", self.op.index, i)
            )
        first, second = paddle.unbind(stacked, 0)
        return first, second

    def average_running(self, serial: Any, operands: list[Any], inplace: bool) -> None:
        """Per-rank statistics: after the op, its running mean / variance averaged over the
        ranks splitting the rows, each weighted by its share n_rank / N (module docstring)."""
        import paddle

        dist: DistAttr = self.state.propagation.op_results[self.op.index].inputs[0]
        shape = self.state.graph.values[self.op.inputs[0]].shape
        local = dist.local_shape(shape, self.rp.rank)
        share = math.prod(int(local[d]) for d in self.split.axes) / self.split.count
        mean_out, variance_out = serial.result(1), serial.result(2)
        paddle.pir.set_insertion_point_after(serial)
        weighted = [paddle.scale(v, share) for v in (mean_out, variance_out)]
        stacked = paddle.stack(weighted)
        mean, variance = self.all_reduce(
            stacked, "local batch-norm running statistics", "running mean and variance, each rank's weighted by "
            "its share of the rows", "so that every replica keeps the same (Strategy(local_batch_norm=True))",
            tag="running_mean_and_variance",
        )  # fmt: skip
        readers = {w.get_defining_op().id() for w in weighted}
        for old, new, target in ((mean_out, mean, operands[1]), (variance_out, variance, operands[2])):
            new.set_type(old.type())
            replace_uses(old, new, readers)
            if inplace:  # the serial op updated the running statistics where they live
                paddle._C_ops.assign_out_(new, target)

    def forward(self, x: Any, mean: Any, variance: Any, scale: Any, bias: Any, inplace: bool) -> list[Any]:
        import paddle

        reserve = paddle.zeros([0], dtype=x.dtype)
        n = float(self.split.count)
        d = paddle.subtract(x, self.b(mean))
        s1, s2 = self.sums(d, paddle.multiply(d, d), "per-channel sums of x and x² (shifted by the running mean)")
        m1 = paddle.scale(s1, 1.0 / n)
        var = paddle.clip(paddle.subtract(paddle.scale(s2, 1.0 / n), paddle.multiply(m1, m1)), min=0.0)
        batch_mean = paddle.add(mean, m1)
        inv_std = paddle.rsqrt(paddle.scale(var, 1.0, self.eps))
        factor = inv_std if scale is None else paddle.multiply(inv_std, scale)
        out = paddle.multiply(paddle.subtract(x, self.b(batch_mean)), self.b(factor))
        if bias is not None:
            out = paddle.add(out, self.b(bias))
        mean_out = paddle.add(paddle.scale(mean, self.momentum), paddle.scale(batch_mean, 1.0 - self.momentum))
        variance_out = paddle.add(paddle.scale(variance, self.momentum), paddle.scale(var, 1.0 - self.momentum))
        if inplace:  # the serial op updates the running statistics where they live
            mean_out = paddle._C_ops.assign_out_(mean_out, mean)
            variance_out = paddle._C_ops.assign_out_(variance_out, variance)
        self.last = variance_out
        return [out, mean_out, variance_out, batch_mean, inv_std, reserve]

    def backward(
        self, x: Any, scale: Any, bias: Any, mean_out: Any, variance_out: Any, saved_mean: Any, saved_variance: Any,
        reserve: Any, out_grad: Any,
    ) -> list[Any]:  # fmt: skip
        import paddle

        n = float(self.split.count)
        x_hat = paddle.multiply(paddle.subtract(x, self.b(saved_mean)), self.b(saved_variance))
        sum_dy, sum_dy_xhat = self.sums(out_grad, paddle.multiply(out_grad, x_hat), "per-channel sums of dy and dy·x̂")
        centered = paddle.subtract(out_grad, self.b(paddle.scale(sum_dy, 1.0 / n)))
        centered = paddle.subtract(centered, paddle.multiply(x_hat, self.b(paddle.scale(sum_dy_xhat, 1.0 / n))))
        factor = saved_variance if scale is None else paddle.multiply(scale, saved_variance)
        x_grad = paddle.multiply(self.b(factor), centered)
        scale_grad = paddle.assign(sum_dy_xhat) if scale is not None else None
        bias_grad = paddle.assign(sum_dy) if bias is not None else None
        self.last = next(v for v in (bias_grad, scale_grad, x_grad) if v is not None)
        return [x_grad, scale_grad, bias_grad]
