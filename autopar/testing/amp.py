"""Mixed-precision programs as users write them, and the numerics twin that runs them on CPU.

Programs are built with Paddle's own AMP API, the form that builds in static PIR programs
(docs/paddle_amp.md): ``paddle.amp.decorate(models, optimizers, level, dtype)`` and
``paddle.amp.auto_cast`` around the forward, ``paddle.amp.GradScaler`` for dynamic loss scaling.

Paddle 3.3.1's CPU build cannot run a bfloat16 training step: bf16 ``matmul_grad`` crashes and
``adamw_`` refuses a bf16 parameter at build. The *numerics twin* makes such a program runnable
while computing what a GPU's bf16 kernels compute: each low-precision ``matmul`` /
``matmul_grad`` becomes its fp32 kernel on its inputs cast up exactly, its results rounded back
to the low precision (a bf16 GEMM accumulating in fp32). The twin rewrites a compiled rank
program (:func:`twinned`, op positions carried over) and the serial program
(:func:`run_serial_twin`) alike, so "distributed = serial" is checked between the two twins,
while the compiled program that is checked as text stays the real mixed-precision one.

Two forms cannot be built here as they are written, so their builders build them another way
and say so: O2 with AdamW (``adamw_`` refuses a bf16 parameter at build: built on fp32
stand-ins, then made to read the bf16 parameter and gradient, so the text is the real op; the
twin runs it on the fp32 master and refreshes the bf16 copy from it, as the multi-precision
kernel does); float16 O1 (built in bf16, then every bf16 value retyped to float16, casts
rebuilt: op for op the program Paddle builds on a GPU, rounded to float16 by the twin, so it
overflows at 65504 as fp16 does); float16 O2 likewise (its startup too), with GradScaler's
check / update ops on the float16 gradients built on fp32 stand-ins as adamw_ is. Dynamic loss
scaling on bf16 forces Paddle's float16 scaling path (Paddle emits scaling ops only for
float16); the gradients it checks are fp32 at O1.

float16 O2 cannot be twinned op by op: this build has no float16 add, activation, matmul,
``sgd_`` or scaling kernel. Its twin holds every float16 value as a float32 *carrier* of a
float16 number (each op's fp32 kernel, its result rounded through float16 right after), the
parameters float16 in the scope, the updates on the fp32 masters, and the collectives in
float16 as their Collective records say (:func:`twin_program`, :func:`_carry_float16`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from autopar.rank_plan import RankPlan
from autopar.rewrites.stage_overflow import scaling_op
from autopar.spmd import trait_values
from autopar.testing.models import SeedProgram
from autopar.testing.serial import SerialResult

TWINNED = trait_values("cpu_twinned")  # op -> how the twin runs it: its low-precision kernel cannot run on this CPU build
LOW_PRECISION = ("bfloat16", "float16")
MASTER = "_fp32_master_0"  # the suffix of an O2 parameter's fp32 master weight


@dataclass(frozen=True)
class Amp:
    """How a program is mixed precision: Paddle's AMP ``level`` ("O1": fp32 parameters, matmuls
    cast to ``dtype``; "O2": ``dtype`` parameters with fp32 master weights; "O0": no AMP, the
    fp32 program), the optimizer, and dynamic loss scaling (``GradScaler``: at O1, and at
    float16 O2 on its float16 gradients; Paddle disables it for bfloat16)."""

    level: str = "O2"
    dtype: str = "bfloat16"
    optimizer: str = "sgd"
    loss_scaling: bool = False
    init_loss_scaling: float = 1024.0

    def __post_init__(self) -> None:
        if self.level not in ("O0", "O1", "O2") or self.dtype not in LOW_PRECISION or self.optimizer not in ("sgd", "adamw"):
            raise ValueError(f"unsupported {self}: levels O0/O1/O2, dtypes {LOW_PRECISION}, optimizers sgd/adamw")
        if self.loss_scaling and (self.level, self.dtype) not in (("O1", "bfloat16"), ("O1", "float16"), ("O2", "float16")):
            raise ValueError(f"{self}: dynamic loss scaling is built at O1 and at float16 O2 (Paddle disables it for bf16)")

    def __str__(self) -> str:
        scaling = " + dynamic loss scaling" if self.loss_scaling else ""
        return f"{self.level} {self.dtype} {self.optimizer}{scaling}"


def amp_mlp(
    amp: Amp, batch: int = 8, widths: Sequence[int] = (8, 16, 4), seed: int = 7, lr: float = 0.05, stages: Any = None
) -> SeedProgram:
    """An MLP (GELU between the linears, cross-entropy on fp32 logits) trained in mixed precision
    as a user writes it. (GELU is smooth: a bf16 rounding never switches a unit off as at a
    ReLU's kink, so two roundings of one run differ by rounding, not by a different branch.) ``layers`` names the linears ``linear1``...; ``values`` holds
    the loss scaling states when ``amp.loss_scaling``. ``stages``: a mesh whose first dim is a
    pipeline's: the linears split evenly over its stages (``autopar.shard_op``), the loss on the
    last."""
    import paddle

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = seed
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():  # the same names every build
        x = paddle.static.data("x", [batch, widths[0]], "float32")
        label = paddle.static.data("label", [batch, 1], "int64")
        layers = {f"linear{i + 1}": paddle.nn.Linear(widths[i], widths[i + 1]) for i in range(len(widths) - 1)}
        model = paddle.nn.Sequential(*[m for i, layer in enumerate(layers.values()) for m in (layer, paddle.nn.GELU())][:-1])
        model, opt = _decorated(amp, model, lr)
        criterion = lambda logits: paddle.mean(paddle.nn.functional.cross_entropy(logits.astype("float32"), label))  # noqa: E731
        with paddle.amp.auto_cast(enable=amp.level != "O0", level=amp.level, dtype="bfloat16"):  # float16: retyped below
            if stages is None:
                loss = criterion(model(x))
            else:
                loss = _staged(model, stages, x, criterion)
        values = minimize(amp, opt, loss)
    if amp.dtype == "float16":
        retype_to_float16(main)
        retype_to_float16(startup)  # O2: the startup casts the parameters to the low precision
    return SeedProgram(main, startup, {"x": x, "label": label}, loss, layers, values)


def _staged(model: Any, mesh: Any, x: Any, criterion: Any) -> Any:
    """``model``'s layers run on ``mesh``'s stages in order (an activation stays with its linear)."""
    import autopar

    blocks = [list(model)[i : i + 2] for i in range(0, len(model), 2)]
    count = mesh.shape[0]
    h = x
    for i, block in enumerate(blocks):
        h = autopar.shard_op(lambda t, block=block: _chain(block, t), mesh[i * count // len(blocks)])(h)
    return autopar.shard_op(criterion, mesh[count - 1])(h)


def _chain(layers: Sequence[Any], t: Any) -> Any:
    for layer in layers:
        t = layer(t)
    return t


def retype_to_float16(program: Any) -> None:
    """``program``, built in bf16, made the float16 program Paddle builds on a GPU: each cast to
    bf16 rebuilt as a cast to float16, every other bf16 value retyped. (This CPU build refuses
    to construct a float16 matmul, so an fp16 program cannot be built directly; at O1 the two
    programs differ only in that dtype.)"""
    import paddle
    from paddle import _C_ops

    float16 = None
    with paddle.static.program_guard(program):
        for op in list(program.global_block().ops):
            if op.name() == "pd_op.cast" and str(op.result(0).dtype) == "paddle.bfloat16":
                paddle.pir.set_insertion_point(op)
                made = _C_ops.cast(op.operand_source(0), paddle.float16)
                made.persistable = op.result(0).persistable  # the startup's parameter casts: set_parameter renames them
                op.result(0).replace_all_uses_with(made)
                op.erase()
                float16 = made.type()
        paddle.pir.reset_insertion_point_to_end()
    if float16 is None:
        return
    for op in program.global_block().ops:
        for value in op.results():
            if value.initialized():
                _retyped(value, "paddle.bfloat16", float16)


def _retyped(value: Any, dtype: str, to: Any) -> None:
    """``value``'s type with each ``dtype`` tensor in it (a dense tensor, or a vector's members:
    a ``builtin.combine`` of gradients, the scaling ops' results) made a tensor of ``to``'s dtype."""
    import paddle

    if value.is_dense_tensor_type():
        if str(value.dtype) == dtype:
            value.set_type(paddle.pir.create_shaped_type(to, value.shape))
        return
    vector = value.type().as_vec_type()
    if vector is not None and any(str(m.dtype) == dtype for m in vector.as_list()):
        members = [paddle.pir.create_shaped_type(to, m.shape) if str(m.dtype) == dtype else m for m in vector.as_list()]
        value.set_type(paddle.base.libpaddle.pir.create_vec_type(members))


def _decorated(amp: Amp, model: Any, lr: float) -> tuple[Any, Any]:
    """``model`` and its multi-precision optimizer through ``paddle.amp.decorate`` (O2 casts
    the parameters, so it comes before the forward is built)."""
    import paddle

    mixed = amp.level != "O0"
    if amp.optimizer == "sgd":
        opt = paddle.optimizer.SGD(lr, parameters=model.parameters(), multi_precision=mixed)
    else:
        opt = paddle.optimizer.AdamW(lr, parameters=model.parameters(), weight_decay=0.01, multi_precision=mixed)
    if not mixed:
        return model, opt
    return paddle.amp.decorate(models=model, optimizers=opt, level=amp.level, dtype="bfloat16")


def minimize(amp: Amp, opt: Any, loss: Any) -> dict[str, Any]:
    """Minimize ``loss`` as the program's form does (``opt`` from ``paddle.amp.decorate``, the
    program built in bf16); when scaling, ``loss_scaling`` (the scale state) and ``scaled`` (the
    scaled loss). A float16 program is then :func:`retype_to_float16`'d by its builder."""
    o2 = amp.level == "O2"
    with _low_precision_adamw() if o2 and amp.optimizer == "adamw" else contextlib.nullcontext():
        if not amp.loss_scaling:
            opt.minimize(loss)
            return {}
        with _low_precision_scaling() if o2 else contextlib.nullcontext():
            return _minimize_scaled(amp, opt, loss)


def _minimize_scaled(amp: Amp, opt: Any, loss: Any) -> dict[str, Any]:
    """Paddle's dynamic loss scaling: its float16 path (the only one that emits the scaling
    ops) forced while the program is built in bf16 (a float16 program is retyped after; a bf16
    one keeps Paddle's float16 scaling on bf16 arithmetic). Gradients are fp32 at O1; at O2
    they are the bf16-built float16 ones, which Paddle's O2 path (``_use_pure_fp16``) checks as
    its "fp16" group: told so here, since it sorts them by the forced dtype."""
    import paddle
    from paddle.amp.auto_cast import amp_global_state
    from paddle.base import core

    opt._amp_vartype = core.DataType.FLOAT16
    if amp.level == "O2":
        opt._split_grads = _split_low_precision_grads
    state = amp_global_state()
    before, state.amp_dtype = state.amp_dtype, "float16"
    try:
        scaler = paddle.amp.GradScaler(
            init_loss_scaling=amp.init_loss_scaling, incr_every_n_steps=2, decr_every_n_nan_or_inf=1, use_dynamic_loss_scaling=True
        )
        scaled = scaler.scale(loss)
        scaler.minimize(opt, scaled)
    finally:
        state.amp_dtype = before
    return {"loss_scaling": scaler._scale, "scaled": scaled}


def _split_low_precision_grads(params_grads: Sequence[tuple[Any, Any]]) -> tuple[list[Any], list[Any], list[Any]]:
    """Paddle's ``OptimizerWithMixedPrecision._split_grads`` with bf16 gradients in the low
    precision group (the program is float16 once retyped)."""
    grads = [g for _, g in params_grads]
    low = [g for g in grads if _is_low(g)]
    return grads, [g for g in grads if not _is_low(g)], low


@contextlib.contextmanager
def _low_precision_scaling() -> Iterator[None]:
    """While building: ``check_finite_and_unscale_`` and ``update_loss_scaling_`` on low-precision
    gradients (float16 O2's: Paddle's GradScaler checks them as they are), which this build
    refuses to construct (their CPU kernels take fp32 / fp64), built on fp32 stand-ins of the
    gradients, then made to read the real ones, their in-place results retyped (the vector and
    its members): the ops Paddle builds on a GPU. The twin runs them on fp32 carriers
    (:func:`twin_program`)."""
    from paddle import _C_ops

    real = {name: getattr(_C_ops, name) for name in ("check_finite_and_unscale_", "update_loss_scaling_")}

    def on_stand_ins(name: str) -> Callable[..., Any]:
        def build(grads: Sequence[Any], *rest: Any) -> Any:
            setattr(_C_ops, name, real[name])  # (scaling_op calls the real builder)
            try:
                return scaling_op(name, grads, *rest)
            finally:
                setattr(_C_ops, name, build)

        return build

    for name in real:
        setattr(_C_ops, name, on_stand_ins(name))
    try:
        yield
    finally:
        for name, builder in real.items():
            setattr(_C_ops, name, builder)


@contextlib.contextmanager
def _low_precision_adamw() -> Iterator[None]:
    """While building: ``adamw_`` on a low-precision parameter with its fp32 master, which this
    build refuses to construct (its CPU kernel takes fp32 / fp64 parameters), built on fp32
    stand-ins of the parameter and gradient, then made to read the real ones, its parameter
    result retyped: the program Paddle builds on a GPU, op for op. The twin runs it
    (:func:`twin_program`)."""
    import paddle
    from paddle import _C_ops

    real = _C_ops.adamw_

    def adamw_(param: Any, grad: Any, *rest: Any) -> Any:
        if str(param.dtype) == "paddle.float32":
            return real(param, grad, *rest)
        stand_ins = [_C_ops.cast(param, paddle.float32), _C_ops.cast(grad, paddle.float32)]
        outs = real(*stand_ins, *rest)
        op = outs[0].get_defining_op()
        op.operand(0).set_source(param)
        op.operand(1).set_source(grad)
        outs[0].set_type(param.type())
        for stand_in in stand_ins:
            stand_in.get_defining_op().erase()
        return outs

    _C_ops.adamw_ = adamw_
    try:
        yield
    finally:
        _C_ops.adamw_ = real


def _is_low(value: Any) -> bool:
    return value.initialized() and str(value.dtype).rsplit(".", 1)[-1] in LOW_PRECISION


@dataclass(frozen=True)
class TwinRewrite:
    """What :func:`twin_program` did, by op id: ``replaced``, each op erased -> the op standing
    for it; ``made_for``, each op inserted -> the op it was made for; ``results``, each result
    ``(op, index)`` of an erased op -> the ``(op, index)`` now making that value."""

    replaced: dict[int, int]
    made_for: dict[int, int]
    results: dict[tuple[int, int], tuple[int, int]]


def twin_program(program: Any, float16_ops: frozenset[int] = frozenset()) -> TwinRewrite:
    """Rewrite ``program`` in place: each op the registry marks ``cpu_twinned`` reading a
    low-precision value is rebuilt as its fp32 kernel (the trait names the attributes it takes:
    the values cast up exactly, each result cast back to its dtype; "on_master": an update of a
    low-precision parameter run on its fp32 master, the parameter then refreshed from it).

    A program with float16 parameters (float16 O2) is run on **float32 carriers** instead: this
    CPU build has no float16 add, activation, matmul or scaling kernel, so every float16 value
    is held as a float32 value carrying a float16 number (:func:`_carry_float16`); only its
    updates (``sgd_``, ``adamw_``) are rewritten onto the master as above. ``float16_ops``: ids of
    ops that must still read and make float16 (a rank plan's collectives: the runtime moves and
    sums float16 by the low-precision rule, autopar/low_precision.py, as the Collective says)."""
    import paddle

    on_carriers = _has_float16_parameters(program)
    done = TwinRewrite({}, {}, {})
    with paddle.static.program_guard(program):
        for op in list(program.global_block().ops):
            name = op.name().removeprefix("pd_op.")
            how = TWINNED.get(name)
            if on_carriers:  # every other op runs its fp32 kernel on the carriers
                how = "on_master" if name in ("sgd_", "adamw_") else None
            if how is None or not any(_is_low(op.operand_source(i)) for i in range(op.num_operands())):
                continue
            old_id, before = op.id(), set(map(_op_id, program.global_block().ops))
            paddle.pir.set_insertion_point(op)
            kernel, made = _on_master(op) if how == "on_master" else _fp32_kernel(op, how)
            for i, new in made.items():
                if not op.result(i).use_empty():
                    op.result(i).replace_all_uses_with(new)
                done.results[(old_id, i)] = (new.get_defining_op().id(), new.index())
            op.erase()
            done.replaced[old_id] = kernel
            done.made_for.update({i: old_id for i in map(_op_id, program.global_block().ops) if i not in before and i != kernel})
        if on_carriers:
            _read_scaling_results(program)
            _carry_float16(program, done, float16_ops)
    paddle.pir.reset_insertion_point_to_end()
    return done


# ops that read and make float16 as they are on this CPU build (cast both ways; the parameter
# and the persistable states read from the scope; the refresh of a parameter from its master)
FLOAT16_KERNELS = ("pd_op.cast", "builtin.parameter", "pd_op.data", "pd_op.assign_out_")


def _has_float16_parameters(program: Any) -> bool:
    return any(op.name() == "builtin.parameter" and str(op.result(0).dtype) == "paddle.float16" for op in program.global_block().ops)


def _carry_float16(program: Any, done: TwinRewrite, float16_ops: frozenset[int]) -> None:
    """``program``'s float16 values held as float32 carriers of float16 numbers, in place.

    Each op making a float16 value without a float16 CPU kernel (everything but
    :data:`FLOAT16_KERNELS` and ``float16_ops``) is retyped to make float32 — its fp32 kernel
    on carriers: a GPU's float16 kernel computing in fp32 — and its result rounded to float16
    right after it (a cast down, made for it), so an fp32 result beyond 65504 becomes inf as in
    float16; the value is carried up (a cast, exact) right before its first reader that needs
    the carrier, made for that reader. So a value a pipeline's update reads crosses from the
    backward as float16 and the runner sums its micro-batches in float32, rounded once, as it
    does for a real float16 gradient. Ops with float16 kernels and ``float16_ops`` (a rank
    plan's collectives: their Collective records say float16, and the runtime receives the
    float16 value and sums it by the low-precision rule) read and make float16 as they are.
    Vectors of float16 tensors (a ``builtin.combine`` of gradients, the scaling ops' results)
    are retyped; their members are rounded where ``builtin.split`` takes them out."""
    import paddle
    from paddle import _C_ops

    float32 = _dense_type(program, "paddle.float32")
    origin = {kernel: op_id for op_id, kernel in done.replaced.items()}

    def made_for(op_id: int) -> int:
        """The op of the program as it came that ``op_id`` serves."""
        while op_id in done.made_for or op_id in origin:
            op_id = done.made_for.get(op_id, origin.get(op_id, op_id))
        return op_id

    held: dict[int, Any] = {}  # value id -> the value holding it in float16
    carried: dict[int, Any] = {}  # value id -> its float32 carrier
    for op in list(program.global_block().ops):
        natively = op.name() in FLOAT16_KERNELS or op.id() in float16_ops or _makes_float16_by_attribute(op)
        for i, source in enumerate(op.operands_source()):
            if not source.initialized() or source.id not in held:
                continue
            if natively:
                op.operand(i).set_source(held[source.id])
                continue
            if source.id not in carried:
                paddle.pir.set_insertion_point(op)
                carried[source.id] = _C_ops.cast(held[source.id], paddle.float32)
                done.made_for[carried[source.id].get_defining_op().id()] = made_for(op.id())
            op.operand(i).set_source(carried[source.id])
        for i, value in enumerate(op.results()):
            if not value.initialized():
                continue
            if not value.is_dense_tensor_type():
                _retyped(value, "paddle.float16", float32)
            elif str(value.dtype) == "paddle.float16" and natively:
                held[value.id] = value
            elif str(value.dtype) == "paddle.float16":
                value.set_type(paddle.pir.create_shaped_type(float32, value.shape))
                paddle.pir.set_insertion_point_after(op)
                held[value.id] = _C_ops.cast(value, paddle.float16)
                down = held[value.id].get_defining_op().id()
                done.made_for[down] = made_for(op.id())
                done.results[(op.id(), i)] = (down, 0)


def _makes_float16_by_attribute(op: Any) -> bool:
    """Whether ``op`` is told to make float16 (a ``full`` or ``full_like`` of dtype float16): its
    kernel makes float16 whatever its inputs, so it cannot make a carrier."""
    return str(op.attrs().get("dtype", "")) == "paddle.float16"


def _read_scaling_results(program: Any) -> None:
    """Each read of a gradient placed after an in-place scaling op (``check_finite_and_unscale_``,
    ``update_loss_scaling_``) moved onto that op's result, in place, as the compile does
    (autopar/rewrites/loss_scaling.py): the reads are right only while the gradient and the
    op's result share one buffer, and a carrier is a new buffer (the op updates the carrier;
    the optimizer would read the float16 value it was carried from, never unscaled). A
    compiled rank program reads the results already; the serial program is moved here."""
    ops = list(program.global_block().ops)
    position = {op.id(): index for index, op in enumerate(ops)}
    for index, op in enumerate(ops):
        if op.name() not in ("pd_op.check_finite_and_unscale_", "pd_op.update_loss_scaling_"):
            continue
        combine = op.operand_source(0).get_defining_op()
        splits = [user for user in op.result(0).all_used_ops() if user.name() == "builtin.split"]
        if combine.name() != "builtin.combine" or len(splits) != 1:
            continue
        for old, new in zip(combine.operands_source(), splits[0].results()):
            for user in old.all_used_ops():
                if position[user.id()] > index:
                    for slot in range(user.num_operands()):
                        if user.operand_source(slot).is_same(old):
                            user.operand(slot).set_source(new)


def _dense_type(program: Any, dtype: str) -> Any:
    """The type of some dense ``dtype`` value of ``program`` (one to build ``dtype`` types from)."""
    for op in program.global_block().ops:
        for value in op.results():
            if value.initialized() and value.is_dense_tensor_type() and str(value.dtype) == dtype:
                return value.type()
    raise ValueError(f"no {dtype} value in the program")


def _fp32_kernel(op: Any, attributes: Sequence[str]) -> tuple[int, dict[int, Any]]:
    """``op`` run in fp32 on its inputs cast up, given its ``attributes`` in order: the fp32
    op's id, and each result's new value (the fp32 one cast back to its dtype)."""
    import paddle
    from paddle import _C_ops

    up = [_C_ops.cast(v, paddle.float32) if _is_low(v) else v for v in op.operands_source()]
    made = getattr(_C_ops, op.name().removeprefix("pd_op."))(*up, *(op.attrs()[name] for name in attributes))
    fp32 = list(made) if isinstance(made, (tuple, list)) else [made]
    return fp32[0].get_defining_op().id(), {
        i: _C_ops.cast(new, op.result(i).dtype) for i, new in enumerate(fp32) if op.result(i).initialized()
    }


def _on_master(op: Any) -> tuple[int, dict[int, Any]]:
    """``adamw_(param, grad, ..., master, ...)`` (or ``sgd_(param, lr, grad, master)``) of a
    low-precision parameter as what its multi-precision kernel computes: the update of the fp32
    master with the gradient cast up, then the parameter written from the new master
    (``assign_out_``). The new update's id, and each result's new value: the parameter, moments,
    beta pows and the master."""
    import paddle
    from paddle import _C_ops

    if op.name() == "pd_op.sgd_":
        param, lr, grad, master = op.operands_source()
        new_master, _ = _C_ops.sgd_(master, lr, _C_ops.cast(grad, paddle.float32), None, False)
        refreshed = _C_ops.assign_out_(_C_ops.cast(new_master, param.dtype), param)
        return new_master.get_defining_op().id(), {0: refreshed, 1: new_master}
    param, grad, *middle, master, skip, beta1, beta2, epsilon = op.operands_source()
    attrs = op.attrs()
    names = ("lr_ratio", "coeff", "with_decay", "lazy_mode", "min_row_size_to_use_multithread")
    outs = _C_ops.adamw_(
        master, _C_ops.cast(grad, paddle.float32), *middle, None, skip if skip.initialized() else None, beta1, beta2, epsilon,
        *(attrs[n] for n in names), False, attrs["use_global_beta_pow"], attrs.get("amsgrad", False),
    )  # fmt: skip
    refreshed = _C_ops.assign_out_(_C_ops.cast(outs[0], param.dtype), param)
    made = {0: refreshed, **{i: outs[i] for i in range(1, 6)}, 6: outs[0]}
    return outs[0].get_defining_op().id(), {i: v for i, v in made.items() if op.result(i).initialized()}


def _op_id(op: Any) -> int:
    return op.id()


def twin_plan(plan: RankPlan) -> RankPlan:
    """``plan`` running the twin: its program cloned and rewritten by :func:`twin_program`,
    every op position the plan holds (collectives, serial values, fetches, pipeline phases and
    pieces) moved to where the op is now; an inserted cast runs where the op it serves runs."""
    program = plan.program.clone()
    old = [op.id() for op in program.global_block().ops]
    done = twin_program(program, frozenset(old[position] for _, position in plan.collectives))
    replaced, made_for = done.replaced, done.made_for
    if not replaced and not made_for:
        return plan
    now = {op_id: i for i, op_id in enumerate(op.id() for op in program.global_block().ops)}
    moved = [now[replaced.get(op_id, op_id)] for op_id in old]
    origin = {op_id: position for position, op_id in enumerate(old)}
    source = [origin[made_for.get(op_id, op_id)] if op_id not in replaced.values() else None for op_id in now]
    for op_id, kernel in replaced.items():
        source[now[kernel]] = origin[op_id]
    role = plan.pipeline
    if role is not None:
        grouped: dict[int, list[int]] = {}
        for position, from_position in enumerate(source):
            grouped.setdefault(from_position, []).append(position)
        pieces = tuple(dataclasses.replace(p, ops=tuple(sorted(q for o in p.ops for q in grouped[o]))) for p in role.pieces)
        role = dataclasses.replace(role, phases=tuple(role.phases[s] for s in source), pieces=pieces)
    def value_at(position: int, result: int) -> tuple[int, int]:
        """Where the value op ``position`` made as ``result`` is made now (a replaced op's
        value: by the op the twin made for it, e.g. the cast back to bf16)."""
        found = done.results.get((old[position], result))
        return (now[found[0]], found[1]) if found is not None else (moved[position], result)

    remapped: dict[int, list[int]] = {}  # op id -> its results made elsewhere now
    for op_id, r in done.results:
        remapped.setdefault(op_id, []).append(r)
    present = [(s, p) for s, p in enumerate(plan.op_positions) if p >= 0]  # (a negative position: not on this rank)
    values = {(s, r): value_at(p, r) for s, p in present for r in remapped.get(old[p], ())}
    return dataclasses.replace(
        plan,
        program=program,
        collectives=tuple((c, moved[p]) for c, p in plan.collectives),
        op_positions=tuple(moved[p] if p >= 0 else p for p in plan.op_positions),
        replaced={**values, **{key: value_at(p, r) for key, (p, r) in plan.replaced.items()}},
        fetch_positions=tuple(value_at(p, r) for p, r in plan.fetch_positions),
        pipeline=role,
    )


class Twinned:
    """A DistributedProgram whose rank plans run the twin (:func:`twin_plan`); everything else
    is the compiled program's. Hand it to ``autopar.simulate`` or ``autopar.Executor``."""

    def __init__(self, dist: Any) -> None:
        self.compiled = dist
        self._plans: dict[Any, RankPlan] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.compiled, name)

    def rank_plan(self, *args: Any, **kwargs: Any) -> RankPlan:
        key = (args, tuple(sorted(kwargs.items())))
        if key not in self._plans:
            self._plans[key] = twin_plan(self.compiled.rank_plan(*args, **kwargs))
        return self._plans[key]


def twinned(dist: Any) -> Twinned:
    return Twinned(dist)


def run_serial_twin(main: Any, startup: Any, feeds: Sequence[Mapping[str, Any]], fetch_list: Sequence[Any]) -> SerialResult:
    """The serial reference of a mixed-precision program: ``main`` cloned and twinned, run from
    ``startup`` in a fresh scope (``main`` itself is untouched). ``parameters`` holds the
    parameters and the fp32 master weights by name."""
    import paddle

    twin, value_in_twin = twin_clone(main, fetch_list)
    fetches_in_twin = [value_in_twin(v) for v in fetch_list]
    scope = paddle.static.Scope()
    exe = paddle.static.Executor(paddle.CPUPlace())
    with paddle.static.scope_guard(scope):
        exe.run(startup)
        fetches = [[np.asarray(v) for v in exe.run(twin, feed=dict(feed), fetch_list=fetches_in_twin)] for feed in feeds]
    return SerialResult(fetches, {n: read_tensor(scope, n) for n in state_names(main)})


def twin_clone(main: Any, values: Sequence[Any] = ()) -> tuple[Any, Callable[[Any], Any]]:
    """A clone of ``main`` rewritten by :func:`twin_program`, and the clone's value for each of
    ``values`` (of ``main``; a twinned op's result: the value the twin makes for it)."""
    twin = main.clone()
    position = {op.id(): i for i, op in enumerate(main.global_block().ops)}
    cloned = list(twin.global_block().ops)
    where = {v.id: (cloned[position[v.get_defining_op().id()]].id(), v.index()) for v in values}  # before the rewrite
    done = twin_program(twin)
    ops = {op.id(): op for op in twin.global_block().ops}

    def value_in_twin(value: Any) -> Any:
        op_id, result = done.results.get(where[value.id], where[value.id])
        return ops[op_id].result(result)

    return twin, value_in_twin


def state_names(program: Any) -> list[str]:
    """Parameters and persistable states (fp32 masters, loss scaling, optimizer moments) a
    program reads from the scope, by name."""
    names = []
    for op in program.global_block().ops:
        if op.name() == "builtin.parameter":
            names.append(str(op.attrs()["parameter_name"]))
        elif op.name() == "pd_op.data" and op.result(0).persistable:
            names.append(str(op.attrs()["name"]))
    return names


def read_tensor(scope: Any, name: str) -> np.ndarray:
    """A scope tensor as numpy; a bf16 one as float32 (exact: bf16 is fp32's upper half)."""
    return as_float32(np.array(scope.find_var(name).get_tensor()))


@dataclass(frozen=True)
class Floor:
    """How far the serial twin lies from the same program in fp32: the rounding of the low
    precision itself. A distributed run rounds its pieces separately (a gradient summed from
    bf16 pieces, a micro-batch's rounded gradient), so it differs from the serial twin by bf16
    roundings; it is held to this floor. (Reordering the batch's rows, the floor of fp32 runs,
    moves the bf16 twin by ~0: it does not change which values are rounded.)"""

    losses: tuple[float, ...]  # per step, |loss of the fp32 program - loss of the serial twin|
    parameters: Mapping[str, float]  # per parameter, max |difference| after the last step


def measured_floor(build: Callable[[Amp], SeedProgram], amp: Amp, feeds: Sequence[Mapping[str, Any]]) -> Floor:
    """The :class:`Floor` of ``build(amp)`` against ``build`` of the same program without AMP."""
    import paddle

    start = paddle.get_rng_state()
    mixed, plain = build(amp), build(dataclasses.replace(amp, level="O0", loss_scaling=False))
    twin = run_serial_twin(mixed.main, mixed.startup, feeds, [mixed.loss])
    paddle.set_rng_state(start)
    fp32 = run_serial_twin(plain.main, plain.startup, feeds, [plain.loss])
    paddle.set_rng_state(start)
    losses = tuple(float(abs(a[0] - b[0])) for a, b in zip(twin.fetches, fp32.fetches))
    names = _parameter_names(plain.main)
    return Floor(losses, {n: float(np.max(np.abs(twin.parameters[n] - fp32.parameters[n]))) for n in names})


def _parameter_names(program: Any) -> list[str]:
    return [str(op.attrs()["parameter_name"]) for op in program.global_block().ops if op.name() == "builtin.parameter"]


def assert_twin_equals_serial(
    build: Callable[[Amp], SeedProgram], amp: Amp, seed: SeedProgram, dist: Any, feeds: Sequence[Mapping[str, Any]]
) -> None:
    """``dist`` (compiled from ``seed = build(amp)``) run twinned in the simulator equals the
    serial twin from one generator state, within twice the :func:`measured_floor`: losses every
    step (against the largest step's floor) and every parameter after the last step (its own).

    Why twice: the distributed run and the serial twin are two bf16 computations of the same
    fp32 result, each about a floor away from it; a wrong collective or placement moves values
    by their own size, far beyond. The simulator also refuses replicated copies (parameters,
    fp32 masters, optimizer states) that differ by a bit."""
    import paddle

    from autopar.runtime.simulator import simulate

    floor = measured_floor(build, amp, feeds)
    start = paddle.get_rng_state()
    result = simulate(twinned(dist), feeds, [seed.loss])
    paddle.set_rng_state(start)
    serial = run_serial_twin(seed.main, seed.startup, feeds, [seed.loss])
    bound = 2 * max(floor.losses)
    for step, (want, got) in enumerate(zip(serial.fetches, result.fetches)):
        error = abs(float(got[0]) - float(want[0]))
        assert error <= bound, f"{amp}: loss at step {step} {float(got[0])}, the serial twin's {float(want[0])}: {error} > {bound}"
    for name, floor_of in floor.parameters.items():
        for copy in (name, name + MASTER):  # the parameter, and its fp32 master (O2) held to the same floor
            if copy in result.parameters:
                error = float(np.max(np.abs(as_float32(result.parameters[copy]) - serial.parameters[copy])))
                assert error <= 2 * floor_of, f"{amp}: {copy} is {error} from the serial twin's, more than twice its floor {floor_of}"


def as_float32(array: np.ndarray) -> np.ndarray:
    """A parameter as float32: a bf16 one read as its uint16 bits is widened exactly."""
    array = np.asarray(array)
    return (array.astype(np.uint32) << 16).view(np.float32) if array.dtype == np.uint16 else array.astype(np.float32)
