"""``autopar.check``: where a distributed program first differs from serial, op by op
(stage: inspection, over the simulator).

"My loss differs from the single-device run" is answered value by value: the serial program and
every rank of the distributed one run from the same generator state on the same feeds, and
every tensor value of the serial program — forward, backward, optimizer update; under a
pipeline, per micro-batch — is compared with the distributed value rebuilt from its placement
(Shard pieces placed by their bounds, Partial pieces reduced, replicas compared with each other;
micro-batch pieces concatenated along the split dim, or summed where they are partial sums over
the micro-batches, or each compared when every micro-batch holds the whole value). The report
names the first op, in program order, whose output differs beyond its tolerance, with its layer,
the placements of its inputs and output, the collectives that fed it and where in the tensor the
difference is largest; then a per-layer summary.

Tolerances mean something. A value's scale is the larger of its own largest element and the
largest terms its op adds up (its largest input, or the product of its two largest: a value that
cancels to ~0, like a conv bias's gradient behind a batch norm, is judged by what it was summed
from). Its ``max |dist - serial|`` may reach ``16 · eps(dtype) · sqrt(K)`` of that scale, ``K``
being how many terms the op sums into one element (a matmul's inner size, a reduction's length,
the rows of a weight gradient), or what its inputs' own differences become through the op
(``16 · sqrt(K)`` x each input's difference x the largest other input): an op may carry and
amplify the rounding it is given, it cannot make a lost micro-batch out of it. The error shown is
the difference over the scale. Integer values compare exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from autopar.collective_kinds import kind_of
from autopar.errors import AutoparError
from autopar.feed_names import WHOLE_BATCH, with_whole_batch_copies
from autopar.rank_plan import ValueKey
from autopar.recompute_clones import remade
from autopar.spmd import ops_where

EPS = {"float64": 2.3e-16, "float32": 1.2e-7, "float16": 9.8e-4, "bfloat16": 7.9e-3}
SUMMING = ("softmax", "norm", "mean", "sum", "cross_entropy", "logsumexp", "max", "min", "prod", "cumsum")
MOVES = ("reshape", "transpose", "flatten", "squeeze", "assign", "slice", "concat", "split", "cast", "stack", "unbind", "expand")
MATMULS = ops_where("contracts", short=True)
SCALES_IN_PLACE = ops_where("scales_in_place", short=True)  # check_finite_and_unscale_, update_loss_scaling_
OVERFLOW_CHECKS = ops_where("checks_overflow", short=True)


@dataclass(frozen=True)
class Difference:
    """One serial value the distributed run does not reproduce."""

    step: int
    key: ValueKey
    value: str  # the value as the user knows it (``grad(W) %12.1``)
    op: str  # its producer (``pd_op.add_n#26``)
    layer: str
    error: float  # max |dist - serial| / max |serial|
    tolerance: float
    max_abs: float
    max_rel: float
    where: tuple[int, ...]  # index of the largest difference
    serial: float  # the values there
    distributed: float
    placement: str
    micro_batch: int | None = None  # the micro-batch that differs (values every micro-batch holds whole)
    replicas: str = ""  # ranks whose copies of the value disagree, when that is the difference
    inputs: tuple[str, ...] = ()  # each input: label, placement, its own error
    collectives: tuple[str, ...] = ()  # the collectives that fed the op, with their reasons

    def __str__(self) -> str:
        where = f" at {list(self.where)}" if self.where else ""
        mb = f", micro-batch {self.micro_batch}" if self.micro_batch is not None else ""
        lines = [
            f"first difference (step {self.step}{mb}): {self.op}" + (f" in {self.layer}" if self.layer else ""),
            f"  output {self.value} {self.placement}: max |dist - serial| = {self.max_abs:.3g}{where} "
            f"(serial {self.serial:.6g}, distributed {self.distributed:.6g}), max rel {self.max_rel:.3g}; "
            f"error {self.error:.3g} > tolerance {self.tolerance:.3g}",
        ]
        if self.replicas:
            lines.append(f"  replicas differ: {self.replicas}")
        lines += [f"  input {text}" for text in self.inputs]
        lines += [f"  fed by {text}" for text in self.collectives] or ["  fed by no collective"]
        return "\n".join(lines)


@dataclass(frozen=True)
class LayerSummary:
    layer: str
    compared: int
    differing: int
    worst: float
    worst_op: str


@dataclass(frozen=True)
class CheckReport:
    """What :func:`check` found: ``clean`` when every value matched; ``first`` the first
    difference in program order (earliest step first); ``differences`` every differing value."""

    steps: int
    compared: int
    differences: tuple[Difference, ...]
    layers: tuple[LayerSummary, ...]
    ranks: int
    micro_batches: int = 1

    @property
    def clean(self) -> bool:
        return not self.differences

    @property
    def first(self) -> Difference | None:
        return self.differences[0] if self.differences else None

    def __str__(self) -> str:
        mb = f", {self.micro_batches} micro-batches" if self.micro_batches > 1 else ""
        head = f"autopar check: {self.steps} step(s), {self.compared} values compared on {self.ranks} ranks{mb}"
        if self.clean:
            return head + ": every value equals serial (within its tolerance)"
        lines = [head + f": {len(self.differences)} value(s) differ", str(self.first), "per layer:"]
        rows = [(s.layer or "(no layer)", f"{s.differing} of {s.compared} differ", f"worst {s.worst:.3g} at {s.worst_op}")
                for s in self.layers if s.differing]  # fmt: skip
        width = max(len(r[0]) for r in rows)
        lines += [f"  {name.ljust(width)}  {count}  {worst}" for name, count, worst in rows]
        clean = [s for s in self.layers if not s.differing]
        if clean:
            lines.append(f"  {len(clean)} other layer(s): every value equals serial")
        return "\n".join(lines)


def check(dist: Any, feeds: Sequence[Mapping[str, Any]] | Mapping[str, Any], steps: int | None = None, fetch_list: Sequence[Any] | None = None) -> CheckReport:
    """Run ``dist`` in the simulator and its serial program from one generator state on ``feeds``
    (one dict per step, or one dict used for every step) and compare every value; see the
    module docstring. ``fetch_list``: values that must be compared (an error if one cannot be,
    e.g. it is not a value of the program); every other tensor value is compared too."""
    from autopar.runtime.replicas import generator_state, use_generator_state

    feeds = _feeds(feeds, steps)
    keys = _keys(dist)
    for item in fetch_list or ():
        if dist.key(item) not in keys:
            raise AutoparError(f"check cannot compare {dist.decisions.serial().values[dist.key(item)].label}: it has no captured value")
    start = generator_state()
    distributed = _distributed_values(dist, keys, feeds)
    use_generator_state(start)
    serial = _serial_values(dist, keys, feeds)
    in_order = _in_serial_order(dist, keys)
    if in_order:  # zig-zag: those values compared with your program's, the distributed ones put back in serial order
        use_generator_state(start)
        yours = _serial_values(dist, in_order, feeds, dist.serial_program)
        serial = [{**want, **mine} for want, mine in zip(serial, yours)]
        drawn = _after_dropout(dist.decisions.serial())  # (the reordered run draws its masks in zig-zag order: no reference there)
        keys = [k for k in keys if k in in_order or k not in drawn]
    return _compare(dist, keys, serial, distributed, frozenset(in_order))


def random_feeds(dist: Any, steps: int = 1, seed: int = 0, int_high: int = 2) -> list[dict[str, np.ndarray]]:
    """``steps`` feed dicts of random global arrays for ``dist``'s program (floats standard
    normal; integers in ``[0, int_high)``, valid token ids and labels of any model by default)."""
    from types import SimpleNamespace

    from autopar.testing.serial import random_feeds as draw

    values = dist.decisions.serial().values
    declared = {
        name: SimpleNamespace(shape=values[key].program_shape, dtype=values[key].dtype)
        for name, key in dist.values.named("feed").items() if not name.endswith(WHOLE_BATCH)
    }  # (the whole batch, not one micro-batch; a whole-batch copy of a feed is given its feed's array)
    return draw(declared, steps, seed=seed, classes=int_high)


# ---- running both sides ----------------------------------------------------------------
def _feeds(feeds: Any, steps: int | None) -> list[Mapping[str, Any]]:
    if isinstance(feeds, Mapping):
        return [feeds] * (steps or 1)
    if isinstance(feeds, (str, bytes)) or not isinstance(feeds, Sequence) or not feeds:
        raise AutoparError(f"check needs feeds: a dict of feed name -> global array, or a list of them (one per step); got {type(feeds).__name__}")
    feeds = list(feeds)
    if steps is not None:
        if steps > len(feeds):
            raise AutoparError(f"check: steps={steps} but only {len(feeds)} feed dicts were given")
        feeds = feeds[:steps]
    return feeds


def _keys(dist: Any) -> list[ValueKey]:
    """Every tensor value of the program the runtime can place (vectors are plumbing; constants
    carry their value in the op and every segment makes them again)."""
    from autopar.op_kinds import CONSTANT_FILLS, CONSTANT_OPS

    graph, values = dist.decisions.serial(), dist.values

    def compared(key: ValueKey) -> bool:
        value, op = graph.values[key], graph.ops[key[0]]
        if key not in values or value.kind in ("vector", "constant") or any(size < 0 for size in value.shape):
            return False  # (a -1 size: an auxiliary output, batch_norm's reserve space)
        if op.name in CONSTANT_FILLS and all(graph.values[k].kind == "constant" for k in op.inputs if k is not None):
            return False  # a constant written from attributes (zig-zag's index): every segment makes it again
        return not (op.name in CONSTANT_OPS and not op.inputs)

    scaled = in_place_scaled(graph)
    keys = [k for k in graph.tensor_keys() if compared(k) and k not in scaled]
    made = makers(graph)
    return sorted(keys, key=lambda k: (made.get(k, k[0]), k))


def in_place_scaled(graph: Any) -> set[ValueKey]:
    """The gradients dynamic loss scaling unscales and zeroes in place, and the check's unscaled
    copies: not compared. A captured gradient is its buffer after those ops ran (serial) or a
    copy made before them (a rank's reshard, a pipeline's accumulated micro-batches), and on an
    overflowing step the ranks' unscaled pieces are discarded values that differ (Paddle's check
    zeroes only the pieces of the rank that saw the overflow). update_loss_scaling_'s results,
    which the optimizer reads, are compared instead (measured: without this, a pipeline's check
    reported its gradients 1024x the serial ones)."""
    found: set[ValueKey] = set()
    for op in graph.ops:
        if op.short_name not in SCALES_IN_PLACE:
            continue
        found |= {k for k in op.inputs if k is not None and graph.values[k].kind == "activation"}
        if op.short_name in OVERFLOW_CHECKS:
            found |= {k for k in op.outputs[:-1] if k is not None}  # (its flag, the last, is compared)
    return found


def makers(graph: Any) -> dict[ValueKey, int]:
    """Parameters and states (read by name, compared as the step leaves them) -> the last op
    updating them in place (an optimizer update, a batch norm's running statistics): where a
    wrong value of theirs is made. Other values are made by their producer."""
    found: dict[ValueKey, int] = {}
    for op in graph.ops:
        if op.short_name.endswith("_"):
            for key in op.inputs:
                if key is not None and graph.values[key].kind in ("parameter", "state"):
                    found[key] = op.index
    return found


def _in_serial_order(dist: Any, keys: list[ValueKey]) -> dict[ValueKey, Any]:
    """``ContextParallel(balance="zigzag")``: the compared values that are values of your
    program (not made by a rewrite) and whose order is known (``ValueInfo.order``: serial, or
    the sequence in zig-zag order along known dims) -> your program's Value. They are compared
    with your program's run, in serial order, so a difference the reordering itself makes is
    found too; the others (the zig-zag copies, a value whose order is not known) with the
    reordered serial program's, both in zig-zag order — except where a dropout's mask reaches
    them (that run draws it in zig-zag order): those are not compared. Empty without zig-zag."""
    infos = {key: dist.values.info(key) for key in keys}
    if not any(info.order is not None for info in infos.values()):
        return {}
    graph, wanted = dist.decisions.serial(), set(keys)
    found = {}
    for op in dist.serial_program.global_block().ops:
        for result in op.results():
            key = _key_of(dist, result) if result.initialized() else None
            if key in wanted and key not in found and (infos[key].order is None or not infos[key].order.unknown):
                found[key] = result
    twins = remade(graph)
    for key in wanted - set(found):  # a recompute clone: its forward twin's Value (the reordered run's dropout is not serial's)
        twin = twins.get(key)
        if twin in found and (infos[key].order is None or not infos[key].order.unknown):
            found[key] = found[twin]
    return found


def _key_of(dist: Any, value: Any) -> ValueKey | None:
    """The key of a Value of your program (None: a value the compile did not analyse)."""
    try:
        return dist.key(value)
    except AutoparError:
        return None


def _after_dropout(graph: Any) -> set[ValueKey]:
    """The values a training dropout's mask reaches (its results and everything made from them)."""
    reached: set[ValueKey] = set()
    for op in graph.ops:
        if (op.short_name == "dropout" and not op.attrs.get("is_test", False)) or any(k in reached for k in op.inputs if k is not None):
            reached.update(k for k in op.outputs if k is not None)
    return reached


def _serial_values(dist: Any, keys: Sequence[ValueKey], feeds: list[Mapping[str, Any]], program: Any = None) -> list[dict[ValueKey, np.ndarray]]:
    """Per step, each of ``keys`` in the serial run of ``program`` (by default the one compile
    analysed: its ops by key; else a mapping key -> Value of ``program``)."""
    import paddle

    if program is None:
        program = dist.decisions.program
        ops = list(program.global_block().ops)
        fetches = [ops[k[0]].result(k[1]) for k in keys]
    else:
        fetches = [keys[k] for k in keys]
    names = [str(op.attrs()["name"]) for op in program.global_block().ops if op.name() == "pd_op.data"]
    scope, executor = paddle.static.Scope(), paddle.static.Executor(paddle.CPUPlace())
    out = []
    with paddle.static.scope_guard(scope):
        if dist.serial_startup_program is not None:
            executor.run(dist.serial_startup_program)
        for feed in feeds:  # (a pipeline's whole-batch copies of feeds: the user gives the feed)
            arrays = executor.run(program, feed=with_whole_batch_copies(feed, names), fetch_list=fetches)
            out.append({k: _numbers(a, dist.values.info(k).dtype) for k, a in zip(keys, arrays)})
    return out


def _numbers(array: Any, dtype: str) -> np.ndarray:
    """A value as numbers to compare: a bfloat16 one comes out of Paddle as its uint16 bits,
    widened here to float32 (exactly), so neither its pieces' sums nor its differences are
    taken on the bits."""
    from autopar.low_precision import widen

    array = np.asarray(array)
    return widen(array, "bfloat16") if dtype == "bfloat16" and array.dtype == np.uint16 else array


def _distributed_values(dist: Any, keys: list[ValueKey], feeds: list[Mapping[str, Any]]) -> list[dict[ValueKey, dict[int, dict[int, np.ndarray]]]]:
    """Per step: key -> rank -> micro-batch -> this rank's piece (micro-batch 0 without a pipeline)."""
    from autopar.runtime.pipeline_runner import PipelineRunner
    from autopar.runtime.simulator import run_step, runner_for, start_ranks

    plans = {rank: dist.rank_plan(rank) for rank in dist.mesh.ranks}
    named = {k: dist.decisions.serial().values[k].name for k in keys if dist.values.info(k).kind in ("parameter", "state")}
    runners = {}
    for rank, plan in plans.items():  # (parameters and states: read by name once the step is done)
        mine = [k for k in keys if k not in named and (k in plan.replaced or plan.op_positions[k[0]] >= 0)]
        runners[rank] = runner_for(plan, mine, capture=True)
    start_ranks(runners)
    out = []
    for feed in feeds:
        run_step(runners, feed)
        step: dict[ValueKey, dict[int, dict[int, np.ndarray]]] = {}
        for rank, runner in runners.items():
            if isinstance(runner, PipelineRunner):
                for key, pieces in runner.captured().items():
                    step.setdefault(key, {})[rank] = {mb: _numbers(p, dist.values.info(key).dtype) for mb, p in pieces.items()}
            else:
                for key, piece in zip(runner.fetch_keys, runner.fetch_pieces()):
                    step.setdefault(key, {})[rank] = {0: _numbers(piece, dist.values.info(key).dtype)}
            for key, name in named.items():
                if runner.scope.find_var(name) is not None:
                    step.setdefault(key, {})[rank] = {0: _numbers(runner.read(name), dist.values.info(key).dtype)}
        out.append(step)
    return out


# ---- comparing --------------------------------------------------------------------------
@dataclass
class _Rebuilt:
    array: np.ndarray | None
    replicas: str = ""
    micro_batch: int | None = None  # (values every micro-batch holds whole: the one compared)
    per_micro_batch: list[np.ndarray] = field(default_factory=list)
    split_dim: int | None = None  # (values split over the micro-batches: the dim they are cut along)


def _compare(dist: Any, keys: list[ValueKey], serial: list[dict], distributed: list[dict], in_order: frozenset = frozenset()) -> CheckReport:
    """``in_order``: the keys whose serial value is in serial order (zig-zag: :func:`_in_serial_order`),
    their distributed value put back in serial order before the comparison."""
    graph = dist.decisions.serial()
    differences: list[Difference] = []
    per_layer: dict[str, list] = {}
    compared = 0
    micro = _micro_batches(dist)
    made, twins = makers(graph), remade(graph)
    scales: dict[ValueKey, float] = {}  # each value's reference scale (a parameter's: from its last update)
    gaps: dict[ValueKey, float] = {}  # each value's max |dist - serial| (a parameter's: after its last update)
    for step, (want, got) in enumerate(zip(serial, distributed)):
        errors: dict[ValueKey, float] = {}
        for key in keys:
            if key not in got:
                continue  # made on no rank (a value the distributed program does not need)
            source = twins[key] if twins.get(key) in want else key
            reference = want[source]
            rebuilt = _rebuild(dist, key, got[key], reference.shape, micro)
            if rebuilt.array is None:
                continue
            if source in in_order:
                rebuilt = _serial_order(dist.values.info(key), rebuilt)
            compared += 1
            maker = made.get(key, key[0])
            terms = scales[key] = max(_term_scale(graph, maker, want), _moved_scale(graph, maker, scales))
            scale = max(float(np.max(np.abs(reference))) if reference.size else 0.0, terms)
            allowed = _allowance(graph, key, maker, want, gaps, scale)
            found = _difference(dist, step, key, maker, reference, rebuilt, allowed, scale, errors, gaps)
            layer = graph.ops[maker].layer
            stats = per_layer.setdefault(layer, [0, 0, 0.0, ""])
            stats[0] += 1
            if found is not None:
                stats[1] += 1
                if found.error > stats[2]:
                    stats[2], stats[3] = found.error, found.op
                differences.append(found)
    layers = tuple(LayerSummary(name, *stats) for name, stats in per_layer.items())
    first = _explained(dist, differences[0]) if differences else None
    ordered = tuple([first] + differences[1:]) if first is not None else ()
    return CheckReport(len(serial), compared, ordered, layers, dist.mesh.size, micro)


def _term_scale(graph: Any, maker: int, want: Mapping[ValueKey, np.ndarray]) -> float:
    """How large the terms op ``maker`` adds up can be: its largest input, or the product of its
    two largest (a matmul's, a product's). A value that cancels to ~0 (a conv bias's gradient
    behind a batch norm is exactly 0) is judged against them, not against its own size."""
    sizes = sorted(
        (float(np.max(np.abs(want[k]))) for k in graph.ops[maker].inputs
         if k is not None and k in want and want[k].size and want[k].dtype.kind == "f"),
        reverse=True,
    )  # fmt: skip
    if not sizes:
        return 0.0
    return max(sizes[0], sizes[0] * sizes[1]) if len(sizes) > 1 else sizes[0]


def _moved_scale(graph: Any, maker: int, scales: Mapping[ValueKey, float]) -> float:
    """An op that only moves or re-lays values (reshape, transpose, slice, a cast, their grads)
    keeps its input's reference scale: a ~0 gradient reshaped is still judged by its terms."""
    if not any(word in graph.ops[maker].short_name for word in MOVES):
        return 0.0
    return max((scales.get(k, 0.0) for k in graph.ops[maker].inputs if k is not None), default=0.0)


def _micro_batches(dist: Any) -> int:
    pipeline = dist.strategy.pipeline
    return pipeline.micro_batches if pipeline is not None else 1


def _rebuild(dist: Any, key: ValueKey, pieces: Mapping[int, Mapping[int, np.ndarray]], shape: tuple[int, ...], micro: int) -> _Rebuilt:
    """The global value from the ranks' pieces, and which replicas disagree."""
    from autopar.pieces import assemble, reduce_partials

    info = dist.values.info(key)
    placement = info.produced
    holders = [r for r in placement.mesh.ranks if r in pieces]
    if len(holders) != len(placement.mesh.ranks):
        return _Rebuilt(None)  # some rank of its mesh did not keep it (a value read by name only)
    made = sorted({mb for r in holders for mb in pieces[r]})
    arrays, replicas = [], ""
    for mb in made:
        if any(mb not in pieces[r] for r in holders):
            return _Rebuilt(None)
        by_rank = {r: pieces[r][mb] for r in holders}
        replicas = replicas or _replica_mismatch(reduce_partials(by_rank, placement), placement, info.shape)
        arrays.append(assemble(by_rank, placement, info.shape))
    if len(arrays) == 1:
        return _Rebuilt(arrays[0] if arrays[0].shape == shape else None, replicas)
    if arrays[0].shape != shape:  # split over the micro-batches: along the dim that shrank
        dim = next(d for d, (a, b) in enumerate(zip(arrays[0].shape, shape)) if a != b)
        return _Rebuilt(np.concatenate(arrays, axis=dim), replicas, per_micro_batch=arrays, split_dim=dim)
    pipeline_role = dist.rank_plan(holders[0]).pipeline
    if pipeline_role is not None and key in pipeline_role.summed:
        return _Rebuilt(np.sum(np.stack(arrays), axis=0), replicas, per_micro_batch=arrays)
    return _Rebuilt(arrays[0], replicas, micro_batch=0, per_micro_batch=arrays)  # the same on every micro-batch


def _serial_order(info: Any, rebuilt: _Rebuilt) -> _Rebuilt:
    """``rebuilt`` (as the program holds it: the sequence in zig-zag order) in serial order."""
    return replace(rebuilt, array=info.in_serial_order(rebuilt.array),
                   per_micro_batch=[info.in_serial_order(a) for a in rebuilt.per_micro_batch])  # fmt: skip


def _replica_mismatch(reduced: Mapping[int, np.ndarray], placement: Any, shape: tuple[int, ...]) -> str:
    """Ranks holding the same piece (after partial sums are reduced) whose copies differ."""
    groups: dict[tuple, list[int]] = {}
    for rank in sorted(reduced):
        piece = tuple((s.start, s.stop) for s in placement.local_slices(shape, rank))
        groups.setdefault(piece, []).append(rank)
    for ranks in groups.values():
        first = reduced[ranks[0]]
        for other in ranks[1:]:
            if not np.array_equal(first, reduced[other], equal_nan=True):
                gap = float(np.max(np.abs(first.astype("float64") - reduced[other].astype("float64")))) if first.size else 0.0
                return f"rank {other}'s copy differs from rank {ranks[0]}'s by up to {gap:.3g}"
    return ""


def reduction_length(graph: Any, key: ValueKey, maker: int | None = None) -> int:
    """How many terms op ``maker`` (default: ``key``'s producer) sums into one element of
    ``key`` (at least 1)."""
    op = graph.ops[key[0] if maker is None else maker]
    out = graph.values[key]
    out_size = max(1, math.prod(out.shape))
    inputs = [graph.values[k] for k in op.inputs if k is not None and graph.values[k].kind != "vector"]
    length = 1
    for value in inputs:  # a reduction, or a weight gradient summing over the rows
        length = max(length, math.prod(value.shape) // out_size)
    short = op.short_name
    if short in MATMULS and inputs and inputs[0].shape:
        x = inputs[0].shape
        length = max(length, x[-2] if op.attrs.get("transpose_x") and len(x) > 1 else x[-1], math.prod(x[:-1]) if short.endswith("_grad") else 1)
    if short.startswith("conv") and len(inputs) > 1:
        length = max(length, math.prod(inputs[1].shape[1:]))
    if any(word in short for word in SUMMING) and inputs and inputs[0].shape:
        length = max(length, inputs[0].shape[-1])
    if short in ("add_n", "sum"):
        length = max(length, len(inputs))
    return length


def _allowance(graph: Any, key: ValueKey, maker: int, want: Mapping[ValueKey, np.ndarray], gaps: Mapping[ValueKey, float], scale: float) -> float:
    """The largest |dist - serial| of ``key`` that rounding explains: ``16 · eps · sqrt(K)`` of its
    scale, or what its inputs' own differences become through the op — each input's gap times
    the largest other input (a product's gain), summed over K terms (``16 · sqrt(K)`` of it)."""
    eps = EPS.get(graph.values[key].dtype)
    if eps is None:
        return 0.0  # integers, booleans: exact
    root = math.sqrt(reduction_length(graph, key, maker))
    inputs = [k for k in graph.ops[maker].inputs if k is not None and k != key and k in want and want[k].dtype.kind == "f"]
    sizes = {k: float(np.max(np.abs(want[k]))) if want[k].size else 0.0 for k in inputs}
    inherited = 0.0
    for k in inputs:
        gain = max([1.0] + [size for other, size in sizes.items() if other != k])
        inherited = max(inherited, gaps.get(k, 0.0) * gain)
    return max(16 * eps * root * scale, 16 * root * inherited)


def _gap(got: np.ndarray, serial: np.ndarray) -> np.ndarray:
    """``|got - serial|`` elementwise, 0 where they are the same value: the same infinity (a
    mask's -inf) or both NaN, which subtracting would turn into NaN."""
    wide = got.astype("float64")
    same = (wide == serial) | (np.isnan(wide) & np.isnan(serial))
    with np.errstate(invalid="ignore"):
        return np.where(same, 0.0, np.abs(wide - serial))


def _difference(
    dist: Any, step: int, key: ValueKey, maker: int, want: np.ndarray, rebuilt: _Rebuilt, allowed: float, scale: float,
    errors: dict, gaps: dict,
) -> Difference | None:  # fmt: skip
    got = rebuilt.array
    if got.shape != want.shape:
        raise AutoparError(f"check: {dist.decisions.serial().values[key].label} is {list(got.shape)} distributed, {list(want.shape)} serial")
    wide, serial = got.astype("float64"), want.astype("float64")
    gap = _gap(wide, serial)
    max_abs = float(np.nanmax(gap)) if gap.size and not np.isnan(gap).all() else 0.0
    micro_batch = None
    if rebuilt.micro_batch is not None and len(rebuilt.per_micro_batch) > 1:  # each micro-batch holds it whole
        for mb, array in enumerate(rebuilt.per_micro_batch):
            mb_gap = _gap(array, serial)
            if mb_gap.size and float(np.max(mb_gap)) > max_abs:
                micro_batch, gap, max_abs = mb, mb_gap, float(np.max(mb_gap))
    if np.isnan(gap).any() and not np.isnan(serial).all():
        max_abs = math.inf
    error = max_abs / scale if scale > 0 else max_abs
    tolerance = allowed / scale if scale > 0 else allowed
    errors[key], gaps[key] = error, max_abs
    differs = max_abs > allowed
    if not differs and not rebuilt.replicas:
        return None
    worst = np.nan_to_num(gap, nan=math.inf)  # a NaN on one side only is the largest difference
    where = tuple(int(i) for i in np.unravel_index(int(np.argmax(worst)), gap.shape)) if gap.size else ()
    if rebuilt.split_dim is not None and where:  # the micro-batch holding that row
        micro_batch = where[rebuilt.split_dim] // rebuilt.per_micro_batch[0].shape[rebuilt.split_dim]
    with np.errstate(invalid="ignore"):
        rel = gap / np.maximum(np.abs(serial), scale * 1e-3 if scale else 1e-30)
    graph = dist.decisions.serial()
    return Difference(
        step=step, key=key, value=dist.decisions.label(key), op=str(graph.ops[maker]), layer=graph.ops[maker].layer,
        error=error, tolerance=tolerance, max_abs=max_abs, max_rel=float(np.nanmax(rel)) if rel.size else 0.0, where=where,
        serial=float(serial[where]) if serial.size else 0.0, distributed=float(wide[where]) if wide.size else 0.0,
        placement=str(dist.values.info(key).produced), micro_batch=micro_batch, replicas=rebuilt.replicas,
        inputs=tuple(f"{dist.decisions.label(k)} {dist.values.info(k).produced}: error {errors.get(k, 0.0):.3g}"
                     for k in graph.ops[maker].inputs if k is not None and k in dist.values),
    )  # fmt: skip


def _explained(dist: Any, found: Difference) -> Difference:
    """``found`` with the collectives that fed its op: those moving one of its inputs."""
    import dataclasses

    graph = dist.decisions.serial()
    op = graph.ops[makers(graph).get(found.key, found.key[0])]
    labels = {graph.values[k].label for k in op.inputs if k is not None} | {dist.decisions.label(k) for k in op.inputs if k is not None}
    seen: dict[Any, str] = {}  # one line per collective (a send and its recv share their key)
    for rank in dist.mesh.ranks:
        for c in dist.comm_ops(rank):
            if c.value in labels or any(f"{label}," in c.reason or c.reason.endswith(label) for label in labels):
                kind = "send/recv" if kind_of(c.kind).sends or kind_of(c.kind).receives else str(c.kind)
                text = f"{kind}(group={sorted(c.group)}) {c.value} {c.src} -> {c.dst}: {c.reason}"
                seen.setdefault(c.key, text if len(text) <= 300 else text[:299] + "…")
    return dataclasses.replace(found, collectives=tuple(seen.values()))
