"""Attention cores: the ``matmul -> (scale / mask) -> softmax -> (dropout) -> matmul`` chains a
program writes by hand, found in a :class:`~autopar.graph.ProgramGraph` (stage: graph -> the
context-parallel rewrites and lowerings).

Context parallelism treats each core as one unit: Ulysses re-splits its q / k / v by heads
around it, ring attention (:mod:`autopar.passes.ring_attention`) replaces it, forward and
backward, in each rank's program. Both need the same facts, found here once from the serial
graph, as the reference models write attention:

- Llama (Meta's ``model.py``): ``matmul(q, k, transpose_y=True) / sqrt(d) + mask -> softmax ->
  matmul(p, v)``;
- GPT-2 (nanoGPT): ``matmul(q, k, transpose_y=True) * (1 / sqrt d) -> where(mask, att, -inf)
  -> softmax -> dropout -> matmul(p, v)`` (PIR spells the broadcast ``where`` as a few
  ``full_like`` / ``add`` / ``cast`` ops around it: all of them are the core's *middle*).

An :class:`AttentionCore` is a frozen value: the forward ops of the chain, q / k / v as the
first matmul reads them, the scores, the probabilities, the output, the middle ops between the
scores and the softmax, the dropout if any, and the backward ops that differentiate the chain
(:func:`attention_cores`). :func:`affine_middle` says whether the middle is affine in the
scores with a scalar coefficient (what a blockwise ring can recompute per block), or why not.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.graph import OpNode, ProgramGraph, Role, ValueKey
from autopar.propagation_result import PropagationResult
from autopar.spmd import ops_where

MIDDLE_OPS = ops_where("attention_middle")  # may sit between the scores and the softmax (autopar/spmd/attention.py)
# ops walked through from the softmax back to the scores (a sequence-local op that is no middle op,
# soft-capping's tanh, is found and then refused by affine_middle, not mistaken for a mask)
WALKED = MIDDLE_OPS | ops_where("sequence_local")
TRIANGLES = ops_where("triangle")  # a mask cut from a tensor shaped like the scores (Paddle's SDPA)
SHAPE_ONLY = {"pd_op.full_like": frozenset({0})}  # operands read for their shape only (Paddle marks none)


@dataclass(frozen=True, slots=True)
class AttentionCore:
    """One attention core of a program (module docstring); op indices and value keys of the
    serial graph. ``ops``: every forward op of the chain in program order (the first matmul,
    the middle, the softmax, the dropout, the second matmul); ``backward``: the ops of the
    backward that differentiate it (from the second matmul's grad to the first's), in program
    order (empty without a backward); ``recomputed``: the backward's clones of the chain's ops
    under recompute (:mod:`autopar.rewrites.recompute`), which the backward ops read instead."""

    ops: tuple[int, ...]
    first: int  # matmul(q, k, transpose_y=True)
    softmax: int
    second: int  # matmul(p, v)
    q: ValueKey
    k: ValueKey
    v: ValueKey
    scores: ValueKey  # the first matmul's result
    probabilities: ValueKey  # the softmax's result
    output: ValueKey  # the second matmul's result
    middle: tuple[int, ...] = ()  # ops between the scores and the softmax (scale, mask), program order
    dropout: int | None = None
    backward: tuple[int, ...] = ()
    recomputed: tuple[int, ...] = ()  # the backward's clones of the chain's ops (Strategy(recompute=...))

    def __post_init__(self) -> None:
        if not (self.first < self.softmax < self.second) or self.first not in self.ops or self.second not in self.ops:
            raise AutoparError(
                f"attention core {self.ops}: its first matmul, softmax and second matmul are out of order"
            )

    def __str__(self) -> str:
        dropout = " -> dropout" if self.dropout is not None else ""
        middle = f" -> {len(self.middle)} middle ops" if self.middle else ""
        return f"attention(matmul#{self.first}{middle} -> softmax#{self.softmax}{dropout} -> matmul#{self.second})"


def attention_cores(graph: ProgramGraph) -> tuple[AttentionCore, ...]:
    """Every attention core of ``graph`` (forward ops only), in program order."""
    found = []
    for op in graph.ops:
        if op.role is Role.FORWARD and op.name == "pd_op.softmax" and _last_axis(graph, op):
            core = _core_at(graph, op)
            if core is not None:
                found.append(core)
    return tuple(found)


def _last_axis(graph: ProgramGraph, op: OpNode) -> bool:
    ndim = len(graph.values[op.inputs[0]].shape)
    return int(op.attrs.get("axis", -1)) in (-1, ndim - 1)


def _core_at(graph: ProgramGraph, softmax: OpNode) -> AttentionCore | None:
    first, middle = _scores_matmul(graph, softmax)
    if first is None:
        return None
    probabilities = softmax.outputs[0]
    dropout, after = None, probabilities
    readers = _forward_readers(graph, after)
    if len(readers) == 1 and graph.ops[readers[0]].name == "pd_op.dropout":
        dropout = readers[0]
        after = graph.ops[dropout].outputs[0]
        readers = _forward_readers(graph, after)
    if len(readers) != 1:
        return None
    second = graph.ops[readers[0]]
    if second.name != "pd_op.matmul" or second.inputs[0] != after or _transposed(second) != (False, False):
        return None
    ops = tuple(
        sorted({first.index, *middle, softmax.index, second.index} | ({dropout} if dropout is not None else set()))
    )
    forward = set(ops)
    backward = tuple(op.index for op in graph.ops if op.role is Role.BACKWARD and _differentiates(graph, op, forward))
    return AttentionCore(
        ops=ops, first=first.index, softmax=softmax.index, second=second.index,
        q=first.inputs[0], k=first.inputs[1], v=second.inputs[1], scores=first.outputs[0],
        probabilities=probabilities, output=second.outputs[0], middle=tuple(sorted(middle)), dropout=dropout,
        backward=_backward_chain(graph, backward, first.index, second.index),
        recomputed=tuple(op.index for op in graph.ops if op.recomputes in forward),
    )  # fmt: skip


def _transposed(op: OpNode) -> tuple[bool, bool]:
    return bool(op.attrs.get("transpose_x", False)), bool(op.attrs.get("transpose_y", False))


def _forward_readers(graph: ProgramGraph, key: ValueKey) -> list[int]:
    return sorted({u for u in graph.values[key].users if graph.ops[u].role is Role.FORWARD})


def _scores_matmul(graph: ProgramGraph, softmax: OpNode) -> tuple[OpNode | None, set[int]]:
    """The ``matmul(q, k, transpose_y=True)`` the softmax's input is made from through middle ops
    only, and those middle ops (the ops on a path from it to the softmax); (None, ...) if none."""
    seen: set[int] = set()
    matmuls: set[int] = set()
    stack = [softmax.inputs[0]]
    while stack:
        key = stack.pop()
        if key is None or key[0] in seen:
            continue
        op = graph.ops[key[0]]
        if op.role is not Role.FORWARD:
            return None, set()
        if op.name == "pd_op.matmul":
            matmuls.add(op.index)
            continue
        if op.name not in WALKED:
            continue  # a mask or a constant built elsewhere: an operand of the middle, not part of it
        seen.add(op.index)
        stack.extend(k for k in op.inputs if k is not None)
    if len(matmuls) != 1:
        return None, set()
    first = graph.ops[matmuls.pop()]
    if _transposed(first) != (False, True):
        return None, set()
    reached = _reachable_from(graph, first.outputs[0], seen)
    return first, {i for i in seen if i in reached}


def _reachable_from(graph: ProgramGraph, key: ValueKey, within: set[int]) -> set[int]:
    """The ops of ``within`` that read ``key`` or a result of such an op."""
    reached: set[int] = set()
    stack = [key]
    while stack:
        for user in graph.values[stack.pop()].users:
            if user in within and user not in reached:
                reached.add(user)
                stack.extend(k for k in graph.ops[user].outputs if k is not None)
    return reached


def _differentiates(graph: ProgramGraph, op: OpNode, forward: set[int]) -> bool:
    return op.forward_op in forward and op.recomputes is None  # (a recompute clone re-runs its op)


def _backward_chain(graph: ProgramGraph, grads: tuple[int, ...], first: int, second: int) -> tuple[int, ...]:
    """The backward ops between the second matmul's grad and the first's: the grads of the chain's
    ops and the ops on a path between them (the scale of a scale's grad has no forward op)."""
    if not grads:
        return ()
    start = next((i for i in grads if graph.ops[i].forward_op == second), None)
    end = next((i for i in grads if graph.ops[i].forward_op == first), None)
    if start is None or end is None:
        return ()
    downstream: set[int] = set()
    stack = [k for k in graph.ops[start].outputs if k is not None]
    while stack:
        for user in graph.values[stack.pop()].users:
            if user <= end and user not in downstream and graph.ops[user].role is Role.BACKWARD:
                downstream.add(user)
                stack.extend(k for k in graph.ops[user].outputs if k is not None)
    upstream: set[int] = set()
    stack = [k for k in graph.ops[end].inputs if k is not None]
    while stack:
        key = stack.pop()
        if key[0] in upstream or key[0] < start:
            continue
        upstream.add(key[0])
        stack.extend(k for k in graph.ops[key[0]].inputs if k is not None)
    return tuple(sorted({start, end} | (downstream & upstream) | set(grads)))


@dataclass(frozen=True, slots=True)
class AffineMiddle:
    """The middle of a core as ``middle(scores) = coefficient * scores + (terms not reading the
    scores)``, elementwise; a ``where`` on the scores' path keeps the scores where it selects
    them (``wheres``: the where ops and whether the scores are their ``x`` (True) or ``y``)."""

    coefficient: float
    path: tuple[int, ...]  # middle ops the scores' values flow through, program order
    wheres: tuple[tuple[int, bool], ...] = ()


def affine_middle(graph: ProgramGraph, core: AttentionCore) -> AffineMiddle:
    """``core``'s middle as an :class:`AffineMiddle`, or an AutoparError naming the op that makes
    it something else (a ring recomputes the middle block by block and differentiates it by its
    coefficient: an op that is not affine in the scores with a scalar coefficient cannot be)."""
    on_path: set[ValueKey] = {core.scores}
    coefficient, path, wheres = 1.0, [], []
    for index in core.middle:
        op = graph.ops[index]
        shape_only = SHAPE_ONLY.get(op.name, frozenset())
        reads = [slot for slot, key in enumerate(op.inputs) if key in on_path and slot not in shape_only]
        if not reads:
            continue
        where = f"{op} in {core}"
        if len(reads) > 1:
            raise AutoparError(f"ring attention: {where} reads the scores twice (not affine in them)")
        slot = reads[0]
        inside = {k for i in core.middle for k in graph.ops[i].outputs if k is not None}
        for other, key in enumerate(op.inputs):
            if other != slot and key is not None and key not in inside and _reads(graph, key, {core.q, core.k}):
                raise AutoparError(f"ring attention: {where} adds to the scores {graph.values[key].label}, made from q or k")
        factor = _factor(graph, op, slot, where)
        if op.name == "pd_op.where":
            wheres.append((index, slot == 1))
        coefficient *= factor
        path.append(index)
        on_path.update(k for k in op.outputs if k is not None)
    if graph.ops[core.softmax].inputs[0] not in on_path:
        raise AutoparError(f"ring attention: the softmax of {core} does not read the scores through its middle")
    return AffineMiddle(coefficient, tuple(path), tuple(wheres))


def _reads(graph: ProgramGraph, key: ValueKey, sources: set[ValueKey]) -> bool:
    """Whether ``key`` is made from one of ``sources`` (through any forward ops)."""
    seen: set[int] = set()
    stack = [key]
    while stack:
        current = stack.pop()
        if current in sources:
            return True
        if current[0] in seen:
            continue
        seen.add(current[0])
        stack.extend(k for k in graph.ops[current[0]].inputs if k is not None)
    return False


def _factor(graph: ProgramGraph, op: OpNode, slot: int, where: str) -> float:
    """The scalar ``op`` multiplies the scores by when they are its operand ``slot``."""
    other = [k for s, k in enumerate(op.inputs) if s != slot and k is not None]
    if op.name == "pd_op.scale":
        return float(op.attrs["scale"])
    if op.name == "pd_op.cast":
        return 1.0
    if op.name in ("pd_op.add", "pd_op.subtract"):
        if op.name == "pd_op.subtract" and slot == 1:
            raise AutoparError(f"ring attention: {where} subtracts the scores from a tensor (the ring keeps +scores)")
        return 1.0
    if op.name == "pd_op.where":
        if slot == 0:
            raise AutoparError(f"ring attention: {where} selects by the scores (a condition on them is not affine)")
        return 1.0
    if op.name in ("pd_op.multiply", "pd_op.divide"):
        const = graph.values[other[0]].const if other else None
        scalar = const is not None and _numel(graph.values[other[0]].shape) == 1
        if not scalar or (op.name == "pd_op.divide" and slot == 1):
            raise AutoparError(
                f"ring attention: {where} {op.short_name}s the scores by a tensor (needs a scalar constant)"
            )
        value = float(const if not isinstance(const, list) else const[0])
        return value if op.name == "pd_op.multiply" else 1.0 / value
    raise AutoparError(
        f"ring attention: {where} is a {op.short_name} of the scores (not scale, add, subtract, multiply / divide by a scalar, where)"
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def ring_gradient_placements(graph: ProgramGraph, first: PropagationResult, name: str) -> dict[ValueKey, DistAttr]:
    """Where ring attention wants each core's K and V gradients (strategy annotations): split by
    sequence over the mesh dim named ``name`` (``dim`` below; a pipeline stage's sub-mesh keeps the names). After a first propagation (q split by sequence over ``dim``,
    K and V read whole: the all_gather plan) they are pending sums over ``dim``, reduced only
    where a later op needs them whole or split, after the layout ops of the backward; the ring
    makes each rank's block of them complete, so placed split they are reduce_scattered right
    after the grad op — which the ring then replaces — and the backward's layout ops run on the
    blocks. A gradient first propagation does not leave pending over ``dim`` is left as it is."""
    made = {}
    for core in attention_cores(graph):
        grads = {graph.ops[i].forward_op: i for i in core.backward}
        for forward in (core.first, core.second):
            grad_op = grads.get(forward)
            key = graph.ops[grad_op].outputs[1] if grad_op is not None else None
            if key is None or key not in first.states:
                continue
            dist = first.dist(key)
            seq = dist.ndim - 2
            dim = dist.mesh.dim_names.index(name) if name in dist.mesh.dim_names else None
            if dim is None or dim not in dist.partial_dims or dist.mapping[seq]:
                continue
            mapping = tuple((dim,) if t == seq else dims for t, dims in enumerate(dist.mapping))
            made[key] = DistAttr.of(dist.mesh, mapping, tuple((d, kind) for d, kind in dist.partial if d != dim))
    return made


def repeated_from(graph: ProgramGraph, key: ValueKey) -> tuple[ValueKey, int] | None:
    """``(kv, rep)`` when ``key`` (a core's K or V, ``[B, H, S, D]``) is grouped-query attention's
    ``repeat_kv`` of ``kv`` (``[B, S, Hkv, D]``: unsqueeze after the heads, expand ``rep`` times,
    reshape to ``Hkv * rep`` heads, transpose heads before the sequence), else None: a ring can
    move ``kv`` and repeat each block where it arrives (``rep`` times fewer bytes)."""
    chain = []
    current = key
    for name in ("pd_op.transpose", "pd_op.reshape", "pd_op.expand", "pd_op.unsqueeze"):
        op = graph.ops[current[0]]
        if op.name != name or op.inputs[0] is None:
            return None
        chain.append(op)
        current = op.inputs[0]
    kv, out = graph.values[current].shape, graph.values[key].shape
    if len(kv) != 4 or len(out) != 4:
        return None
    batch, seq, heads, dim = kv
    rep = out[1] // heads if heads else 0
    shapes = [graph.values[op.outputs[0]].shape for op in chain]  # transpose, reshape, expand, unsqueeze
    expected = [(batch, heads * rep, seq, dim), (batch, seq, heads * rep, dim), (batch, seq, heads, rep, dim), (batch, seq, heads, 1, dim)]
    if rep < 2 or [tuple(s) for s in shapes] != expected or list(chain[0].attrs.get("perm", ())) != [0, 2, 1, 3]:
        return None
    return current, rep
