"""The real (un-twinned) mixed-precision rank programs, checked as text against the installed
Paddle, as tests/unit/test_device.py checks the APIs the GPU path calls.

Programs: Paddle's AMP as users write it (``autopar.testing.amp.amp_mlp``: ``paddle.amp.decorate``
+ ``auto_cast``), bf16 O1 with SGD and with AdamW, bf16 O2 with SGD(multi_precision) and AdamW
(which this CPU build cannot construct on a bf16 parameter: built on fp32 stand-ins, then the
real operands), float16 O1, and float16 O2 with SGD and AdamW and GradScaler's dynamic loss
scaling on its float16 gradients (the bf16 build retyped; the scaling ops built as AdamW is),
compiled on dp = 2, mp = 2, ZeRO-2 on dp = 2 and a 2-stage pipeline; every rank's program in
its **native** form (``dist.rank_plan(rank, backend="native")``: the collectives as Paddle ops),
and its startup (at O2: the parameters cast to the low precision, the masters cast back).

Where the native form cannot be built here, the refusal must name why — a collective of a dtype
this CPU build has no kernel for (Paddle's CPU build has no bf16 all_reduce / reduce_scatter:
bf16 O2 on dp, mp and ZeRO-2; float16 ones it has), or a pipeline's send / recv (static gloo
programs have none) — and the host form (the same program with the collectives the host
backend runs) is checked instead.

Checked on every op: its name is an op of the installed Paddle — declared in the installed PIR
headers (``pd_op.h``, ``manual_op.h``, ``builtin_op.h``: the op classes Paddle registers) and,
for a forward ``pd_op``, a ``paddle._C_ops`` builder; its operands are those of the header's operand accessors
(count, and names in order) and of the live registry (``Operation.get_input_names``: the
registered OpYamlInfo). Then where AMP put the casts and the masters: O1 parameters stay fp32 and reach
each matmul through a cast to the low precision; the optimizer updates fp32 parameters with fp32
gradients and no master. O2 parameters are low precision and reach matmuls as they are; each
optimizer op updates a low-precision parameter from its fp32 master (``<param>_fp32_master_0``, the operand Paddle names
``master_param``), the master's piece shaped as the parameter's piece it
updates and as the compiled placement of the master gives it on that rank; every parameter a
rank holds is updated by exactly one optimizer op.
"""

import collections
import re
from pathlib import Path

import paddle
import pytest

import autopar
from autopar.errors import NativeUnsupported
from autopar.testing.amp import Amp, amp_mlp

HEADERS = (
    "fluid/pir/dialect/operator/ir/pd_op.h",
    "fluid/pir/dialect/operator/ir/manual_op.h",
    "pir/include/core/builtin_op.h",
)
OPTIMIZERS = ("pd_op.sgd_", "pd_op.adamw_")  # the master is their operand named "master_param"
MASTER = "_fp32_master_0"
PASS_THROUGH = ("pd_op.slice", "pd_op.reshape")  # a ZeRO shard of a parameter: still that parameter

AMPS = (
    Amp("O1", optimizer="sgd"),
    Amp("O1", optimizer="adamw"),
    Amp("O2", optimizer="sgd"),
    Amp("O2", optimizer="adamw"),  # built on fp32 stand-ins, then the real operands (autopar.testing.amp)
    Amp("O1", dtype="float16", optimizer="sgd"),
    Amp("O1", dtype="float16", optimizer="adamw", loss_scaling=True),
    Amp("O2", dtype="float16", optimizer="sgd", loss_scaling=True),  # (the bf16 build retyped; its scaling ops built
    Amp("O2", dtype="float16", optimizer="adamw", loss_scaling=True),  # on fp32 stand-ins, then the real operands)
)
LAYOUTS = ("dp", "mp", "zero2", "pp")
CASES = [(amp, layout) for amp in AMPS for layout in LAYOUTS]
BF16_COLLECTIVE = r"native backend: {} of .*\(bfloat16, .*\) cannot be built: this Paddle build has no bfloat16 kernel"
SEND_RECV = r"native backend: a pipeline's send / recv .*static gloo programs have no send / recv kernel"


def native_refusal(amp, layout):
    """Why the native form cannot be built here (a regex of the refusal), or None: it builds."""
    if layout == "pp":
        return SEND_RECV
    if amp.level == "O2" and amp.dtype == "bfloat16":  # bf16 gradients (dp, ZeRO) and bf16 row-parallel outputs (mp)
        return BF16_COLLECTIVE.format("reduce_scatter" if layout == "zero2" else "all_reduce")
    return None


@pytest.fixture(scope="module")
def signatures():
    """Op name -> its operands' names in order (None: variadic) for every op class the installed
    headers declare (``pir::Value grad() { return operand_source(2); }``)."""
    root = Path(paddle.__file__).parent / "include" / "paddle"
    found = {}
    for header in HEADERS:
        for block in re.split(r"\nclass ", (root / header).read_text())[1:]:
            name = re.search(r'static const char \*name\(\) \{ return "([\w.]+)"; \}', block)
            if name is None:
                continue
            accessors = dict(
                (int(i), operand)
                for operand, i in re.findall(r"(\w+)\(\) \{ return operand_source\((\d+)\); \}", block)
            )
            variadic = "num_operands()" in block
            found[name.group(1)] = None if variadic else tuple(accessors[i] for i in range(len(accessors)))
    assert (
        found["pd_op.sgd_"] == ("param", "learning_rate", "grad", "master_param") and found["builtin.combine"] is None
    )
    assert len(found["pd_op.adamw_"]) == 13 and found["pd_op.adamw_"][8] == "master_param"
    return found


def compiled(amp, layout):
    mesh = autopar.ProcessMesh([0, 1], ["pp" if layout == "pp" else "mp" if layout == "mp" else "dp"])
    seed = amp_mlp(amp, widths=(8, 16, 16, 4), batch=12, stages=mesh if layout == "pp" else None)
    strategy = autopar.Strategy()
    if layout in ("dp", "zero2"):
        autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
        strategy = autopar.Strategy(zero_stage=2 if layout == "zero2" else 0)
    elif layout == "mp":
        autopar.shard_tensor(seed.layers["linear1"].weight, mesh, [None, "mp"])
        autopar.shard_tensor(seed.layers["linear2"].weight, mesh, ["mp", None])
    else:
        strategy = autopar.Strategy(pipeline=autopar.PipelineConfig(micro_batches=2))
    return seed, autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)


def checked_plan(dist, rank, refusal):
    """The native form, or (when ``refusal`` says why it cannot be built) the refusal checked and
    the host form."""
    if refusal is None:
        return dist.rank_plan(rank, backend="native")
    with pytest.raises(NativeUnsupported, match=refusal):
        dist.rank_plan(rank, backend="native")
    return dist.rank_plan(rank, backend="host")


def dtype(value):
    return str(value.dtype).removeprefix("paddle.")


def defining(value):
    return value.get_defining_op() if value.initialized() else None


def parameter_of(value):
    """The parameter name a value is (a shard of), or None."""
    op = defining(value)
    while op is not None and op.name() in PASS_THROUGH:
        op = defining(op.operand_source(0))
    return str(op.attrs()["parameter_name"]) if op is not None and op.name() == "builtin.parameter" else None


def check_signatures(program, signatures):
    check_signatures_of(program.global_block().ops, signatures)


def check_signatures_of(ops, signatures):
    for op in ops:
        name = op.name()
        assert name in signatures, f"{name} is not an op the installed Paddle declares"
        if name.startswith("pd_op."):
            if not name.endswith("_grad"):  # (a backward op is built by its forward's vjp: some have no builder)
                assert hasattr(paddle._C_ops, name.removeprefix("pd_op.")), f"paddle._C_ops has no builder for {name}"
            registered = tuple(op.get_input_names())
            assert op.num_operands() == len(signatures[name]) and registered == signatures[name], (name, registered)
        elif signatures[name] is not None:
            assert op.num_operands() == len(signatures[name]), name


def check_matmul_inputs(ops, amp):
    """O1: each fp32 parameter reaches its matmul through a cast to the low precision; O2: the
    low-precision parameter itself."""
    parameters = {str(op.attrs()["parameter_name"]): op for op in ops if op.name() == "builtin.parameter"}
    assert parameters, "a rank program without parameters"
    want = "float32" if amp.level == "O1" else amp.dtype
    assert {n: dtype(op.result(0)) for n, op in parameters.items()} == dict.fromkeys(parameters, want)
    matmuls = [op for op in ops if op.name() == "pd_op.matmul"]
    assert matmuls
    for op in matmuls:
        weight = op.operand_source(1)
        assert dtype(op.operand_source(0)) == dtype(weight) == amp.dtype
        source = defining(weight)
        if amp.level == "O1":
            assert source.name() == "pd_op.cast" and dtype(source.operand_source(0)) == "float32"
            assert parameter_of(source.operand_source(0)) in parameters
        else:
            assert parameter_of(weight) in parameters
    return parameters


def check_updates(plan, ops, amp, parameters):
    """Every parameter the rank holds updated by one optimizer op; O1 without a master; O2 from
    its fp32 master, whose piece is the parameter piece's shape and its own placement's."""
    updated = collections.Counter()
    for op in (op for op in ops if op.name() in OPTIMIZERS):
        names = op.get_input_names()
        param, grad = op.operand_source(names.index("param")), op.operand_source(names.index("grad"))
        master = op.operand_source(names.index("master_param"))
        name = parameter_of(param)
        assert name in parameters, f"{op.name()} updates {param}, not a parameter"
        updated[name] += 1
        if amp.level == "O1":
            assert (dtype(param), dtype(grad), master.initialized()) == ("float32", "float32", False)
            assert op.attrs()["multi_precision"] is False
            continue
        assert (dtype(param), dtype(grad), dtype(master)) == (amp.dtype, amp.dtype, "float32")
        assert op.attrs()["multi_precision"] is True
        data = defining(master)
        assert data.name() == "pd_op.data" and data.attrs()["name"] == name + MASTER and master.persistable
        assert master.shape == param.shape, f"{name}'s master piece {master.shape}, its parameter's {param.shape}"
        info = plan.values.info(plan.values.key(name + MASTER))
        local = [s.stop - s.start for s in info.placement.local_slices(info.shape, plan.rank)]
        assert list(master.shape) == local, f"{name + MASTER} on rank {plan.rank}: {master.shape}, placed {local}"
    assert updated == collections.Counter(dict.fromkeys(parameters, 1)), updated
    masters = sorted(
        str(op.attrs()["name"]) for op in ops if op.name() == "pd_op.data" and str(op.attrs()["name"]).endswith(MASTER)
    )
    assert masters == ([] if amp.level == "O1" else sorted(n + MASTER for n in parameters))


def check_loss_scaling(ops, amp):
    """With dynamic loss scaling: one check_finite_and_unscale_ and one update_loss_scaling_ over
    the gradients as the optimizer gets them (fp32 at O1; float16 at float16 O2, as Paddle's
    GradScaler checks them on a GPU), each updating them in place (its vector result typed as
    its vector operand); AdamW skips its update on the found_inf flag (its skip_update operand)."""
    checks = [op for op in ops if op.name() == "pd_op.check_finite_and_unscale_"]
    updates = [op for op in ops if op.name() == "pd_op.update_loss_scaling_"]
    assert (len(checks), len(updates)) == ((1, 1) if amp.loss_scaling else (0, 0))
    if not amp.loss_scaling:
        return
    want = "float32" if amp.level == "O1" else amp.dtype
    for op in (checks[0], updates[0]):
        grads = defining(op.operand_source(0))
        assert grads.name() == "builtin.combine" and {
            dtype(grads.operand_source(i)) for i in range(grads.num_operands())
        } == {want}, op.name()
        assert str(op.result(0).type()) == str(op.operand_source(0).type()), op.name()
    for op in (op for op in ops if op.name() == "pd_op.adamw_"):
        skip = op.operand_source(op.get_input_names().index("skip_update"))
        assert skip.initialized() and dtype(skip) == "bool", "adamw_ would not skip an overflowing step"


def check_startup(plan, amp, signatures):
    """The rank's startup: ops of the installed Paddle; at O2 each parameter it sets is the fp32
    initializer cast to the low precision (as ``paddle.amp.decorate`` builds it), and each fp32
    master is a parameter's low-precision value cast back (the rank's piece: through a slice)."""
    ops = list(plan.startup.global_block().ops)
    assert {op.name() for op in ops} <= set(signatures), "an op the installed Paddle does not declare"
    check_signatures_of((op for op in ops if op.name().startswith("pd_op.")), signatures)  # (the header declares no operand of set_parameter)
    if amp.level != "O2":
        return
    sets = [op for op in ops if op.name() == "builtin.set_parameter"]
    masters = [op for op in ops if op.name() == "builtin.shadow_output" and str(op.attrs()["output_name"]).endswith(MASTER)]
    assert sets and len(masters) == len(sets), (len(sets), len(masters))
    for op in sets:
        source = through_slices(defining(op.operand_source(0)))
        assert (source.name(), dtype(source.operand_source(0)), dtype(source.result(0))) == ("pd_op.cast", "float32", amp.dtype)
    for op in masters:
        source = through_slices(defining(op.operand_source(0)))
        assert (source.name(), dtype(source.operand_source(0)), dtype(source.result(0))) == ("pd_op.cast", amp.dtype, "float32")


def through_slices(op):
    while op.name() in PASS_THROUGH:
        op = defining(op.operand_source(0))
    return op


def casts(ops):
    return collections.Counter(
        (dtype(op.operand_source(0)), dtype(op.result(0))) for op in ops if op.name() == "pd_op.cast"
    )


@pytest.mark.parametrize("amp, layout", CASES, ids=str)
def test_mixed_precision_rank_programs_match_paddles_op_signatures(signatures, amp, layout):
    seed, dist = compiled(amp, layout)
    serial, found = casts(seed.main.global_block().ops), collections.Counter()
    for rank in dist.mesh.ranks:
        plan = checked_plan(dist, rank, native_refusal(amp, layout))
        check_signatures(plan.program, signatures)
        ops = list(plan.program.global_block().ops)
        check_updates(plan, ops, amp, check_matmul_inputs(ops, amp))
        check_loss_scaling(ops, amp)
        check_startup(plan, amp, signatures)
        if layout == "pp":
            found += casts(ops)
        else:  # every rank casts what the serial program casts, where AMP put it
            assert casts(ops) == serial, f"rank {rank}: casts {casts(ops)}, the serial program's {serial}"
    if layout == "pp":  # the stages split the serial program's casts between them
        assert found == serial
