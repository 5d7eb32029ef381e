"""Pipelined seed programs: layers placed on stages with ``autopar.shard_op`` (used by tests,
the pipeline example and benchmarks). Nothing else is annotated."""

from __future__ import annotations

from typing import Any

from autopar.testing.models import SeedProgram, _static, make_optimizer


def staged_mlp(
    mesh: Any, widths: tuple[int, ...] = (16, 32, 16, 10), stages: int = 2, batch: int = 12,
    optimizer: str = "momentum", seed: int | None = 7, placement: tuple[int, ...] | None = None,
) -> SeedProgram:  # fmt: skip
    """The primer's SimpleNet as a pipeline: Linear layers with ReLU, cross-entropy; layer ``i``
    on ``mesh[i * stages // layers]``, or on ``mesh[placement[i]]`` (e.g. ``(0, 1, 0, 1)``:
    two virtual stages per pipeline rank). ``seed=None``: no program.random_seed."""
    import autopar

    paddle, main, startup = _static()
    if seed is not None:
        main.random_seed = startup.random_seed = seed
    layers = len(widths) - 1
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [batch, widths[0]], "float32")
        label = paddle.static.data("label", [batch, 1], "int64")
        mods, h = {}, x
        for i in range(layers):
            linear = mods[f"linear{i + 1}"] = paddle.nn.Linear(widths[i], widths[i + 1])
            last = i == layers - 1

            def block(t: Any, linear: Any = linear, last: bool = last) -> Any:
                out = linear(t)
                return out if last else paddle.nn.functional.relu(out)

            where = placement[i] if placement is not None else i * stages // layers
            h = autopar.shard_op(block, mesh[where])(h)
        last = placement[-1] if placement is not None else stages - 1
        loss = autopar.shard_op(lambda o: paddle.mean(paddle.nn.functional.cross_entropy(o, label)), mesh[last])(h)
        make_optimizer(optimizer).minimize(loss)
    return SeedProgram(main, startup, {"x": x, "label": label}, loss, mods)
