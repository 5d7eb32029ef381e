"""ProgramGraph: a read-only networkx view of a PIR program (stage: graph).

Nodes are ops (``("op", i)``, ``i`` = position in the global block) and values
(``("v", i, j)`` = result ``j`` of op ``i``); edges run value -> op (operand position) and
op -> value (result position). Every op carries its role (forward, backward, optimizer) and
every grad op the index of its forward op.

Paddle's vector plumbing is flattened: an op reading a ``builtin.combine`` reads the combined
tensors, an op whose vector result feeds ``builtin.split`` produces the split tensors, so rules
see plain tensor lists (``concat([x, y], axis)``). Building the view never touches the program.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from autopar.errors import AutoparError
from autopar.op_kinds import SOURCE_OPS
from autopar.spmd import ops_where

ValueKey = tuple[int, int]  # (op index, result index)

VECTOR_OPS = ops_where("packs_vector")  # builtin.combine / builtin.split (declared in the rule registry)
OPTIMIZER_OPS = ops_where("updates_parameter")  # sgd_, adamw_, ...


UPDATE_ROLE = 2  # Paddle's op_role attribute of the optimizer phase


class Role(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


@dataclass
class OpNode:
    """One op: name, attrs, logical operand/result value keys (vectors flattened)."""

    index: int
    name: str
    attrs: dict[str, Any]
    inputs: list[ValueKey | None]  # None: an absent optional operand
    input_names: list[str]
    outputs: list[ValueKey | None]  # None: a null result (e.g. a grad nobody needs)
    role: Role = Role.FORWARD
    forward_op: int | None = None  # for grad ops: the forward op they differentiate (recompute clones: the op they re-run)
    recomputes: int | None = None  # recompute clones (autopar.rewrites.recompute): the forward op whose results this op re-makes
    op_id: int = 0
    # where each input is an operand in the program: (op index, operand index); a member
    # of a vector operand is an operand of its builtin.combine (-1: of no op; not replaceable)
    sites: list[tuple[int, int]] = field(default_factory=list)
    shape_only: frozenset[int] = frozenset()  # input positions read for their shape only (Paddle's no-need-buffer)

    @property
    def short_name(self) -> str:
        return self.name.split(".", 1)[-1]

    def __str__(self) -> str:
        return f"{self.name}#{self.index}"


@dataclass
class ValueNode:
    """One tensor value: global shape, dtype, and its name where it has one."""

    key: ValueKey
    shape: tuple[int, ...]
    dtype: str
    name: str | None = None  # parameter / feed / persistable data name
    kind: str = "activation"  # "parameter", "feed", "state" (persistable data), "constant", "activation"
    const: Any = None  # value of a full_int_array / full constant
    users: list[int] = field(default_factory=list)
    declared: tuple[int, ...] | None = None  # the program's shape, where micro-batching made ``shape`` smaller

    @property
    def label(self) -> str:
        return self.name or f"%{self.key[0]}.{self.key[1]}"

    @property
    def program_shape(self) -> tuple[int, ...]:
        """The shape the serial program declares (``shape`` is one micro-batch's)."""
        return self.declared if self.declared is not None else self.shape


class ProgramGraph:
    """The view compile works on; ``graph.nx`` is the underlying ``networkx.DiGraph``."""

    def __init__(self, program: Any, recomputes: Mapping[int, int] | None = None) -> None:
        """``recomputes``: op index -> index of the forward op it recomputes (the clones a
        serial recompute rewrite inserted before the backward; they get the backward role)."""
        self.program = program
        self.ops: list[OpNode] = []
        self.values: dict[ValueKey, ValueNode] = {}
        self.by_name: dict[str, ValueKey] = {}
        self._by_impl: dict[str, ValueKey] = {}
        self.op_aliases: dict[int, int] = {}  # op id of another program's op -> index (see alias)
        self.vectors: dict[ValueKey, list[ValueKey]] = {}  # vector value -> member tensors
        self.view_shapes: dict[ValueKey, tuple[int, ...]] = {}  # what derived views replaced (see derived)
        self.view_attrs: dict[int, dict[str, Any]] = {}
        self.removed: dict[str, str] = {}  # id of a Value a rewrite removed as dead -> its label (autopar.rewrites.dead_ops)
        self._build(list(program.global_block().ops))
        for clone, origin in (recomputes or {}).items():
            self.ops[clone].recomputes = self.ops[clone].forward_op = origin
        assign_roles(self)

    def alias(self, values: Mapping[str, ValueKey], ops: Mapping[int, int]) -> None:
        """Let the Values (by id) and ops (by op id) of the program this one was rewritten from
        (the user's, before a serial rewrite) stand for these keys and op indices."""
        self._by_impl.update(values)
        self.op_aliases.update(ops)

    # ---- construction ----------------------------------------------------------------
    def _build(self, raw_ops: list[Any]) -> None:
        keys: dict[str, ValueKey] = {}
        for index, op in enumerate(raw_ops):
            for j, result in enumerate(op.results()):
                if result.initialized():
                    keys[result.id] = (index, j)
        self._by_impl = keys
        for index, op in enumerate(raw_ops):
            name = op.name()
            if name == "builtin.combine":
                self.vectors[(index, 0)] = [keys[s.id] for s in op.operands_source()]
        for index, op in enumerate(raw_ops):
            if op.name() == "builtin.split":  # a member nobody needs (a stop-gradient input's grad) is null
                source = keys[op.operand_source(0).id]
                self.vectors[source] = [(index, j) if r.initialized() else None for j, r in enumerate(op.results())]
        for index, op in enumerate(raw_ops):
            self._add_op(index, op, keys)

    def _add_op(self, index: int, op: Any, keys: dict[str, ValueKey]) -> None:
        name = op.name()
        if op.num_regions():
            raise AutoparError(
                f"{name}#{index} has {op.num_regions()} region(s) (control flow: paddle.static.nn.cond / while_loop): "
                "autopar does not propagate placements into control-flow regions yet; keep the control flow "
                "outside the compiled program, or express it with ops such as paddle.where"
            )
        attrs = {k: v for k, v in op.attrs().items() if k != "op_callstack"}
        try:
            input_names = list(op.get_input_names())
        except ValueError:
            input_names = [f"operand{i}" for i in range(op.num_operands())]
        inputs: list[ValueKey | None] = []
        names: list[str] = []
        sites: list[tuple[int, int]] = []
        shape_only: set[int] = set()
        for pos, source in enumerate(op.operands_source()):
            label = input_names[pos] if pos < len(input_names) else f"operand{pos}"
            if not source.initialized():
                inputs.append(None)
                names.append(label)
                sites.append((index, pos))
                continue
            key = keys[source.id]
            members = self.vectors.get(key) if name not in VECTOR_OPS else None
            if members is not None and self.values.get(key) is not None and self.values[key].kind == "vector":
                inputs.extend(members)
                names.extend(f"{label}[{i}]" for i in range(len(members)))
                combined = self.ops[key[0]].name == "builtin.combine"
                sites.extend((key[0], i) if combined else (index, -1) for i in range(len(members)))
            else:
                if name.endswith("_grad") and op.is_no_need_buffer(source):
                    shape_only.add(len(inputs))
                inputs.append(key)
                names.append(label)
                sites.append((index, pos))
        outputs: list[ValueKey | None] = []
        for j, result in enumerate(op.results()):
            if not result.initialized():
                outputs.append(None)
                continue
            node = self._value_node((index, j), result, op, name, attrs)
            self.values[node.key] = node
            members = self.vectors.get(node.key)
            if members is not None and name not in VECTOR_OPS and node.kind == "vector":
                outputs.extend(members)
            else:
                outputs.append(node.key)
        node = OpNode(index, name, attrs, inputs, names, outputs, op_id=op.id(), sites=sites, shape_only=frozenset(shape_only))
        self.ops.append(node)
        for key in inputs:
            if key is not None:
                self.values[key].users.append(index)
        for name_attr, key in _constant_inputs(node, self.values):
            node.attrs.setdefault(name_attr, self.values[key].const)

    def _value_node(self, key: ValueKey, result: Any, op: Any, op_name: str, attrs: dict[str, Any]) -> ValueNode:
        if not result.is_dense_tensor_type():
            return ValueNode(key, (), "vector", kind="vector")
        shape = tuple(int(s) for s in result.shape)
        dtype = str(result.dtype).replace("paddle.", "")
        name, kind, const = None, "activation", None
        if op_name == "builtin.parameter":
            name, kind = attrs["parameter_name"], "parameter"
        elif op_name == "pd_op.data":
            name = attrs["name"]
            kind = "state" if attrs.get("persistable", [False])[0] else "feed"
        elif op_name == "pd_op.full_int_array":
            kind, const = "constant", list(attrs["value"])
        elif op_name == "pd_op.full":
            kind, const = "constant", attrs["value"]
        if name is not None:
            self.by_name[name] = key
        return ValueNode(key, shape, dtype, name, kind, const)

    @functools.cached_property
    def nx(self) -> nx.DiGraph:
        """The graph as a networkx DiGraph (built on first use: compile itself walks ``ops``)."""
        graph = nx.DiGraph()
        for key, value in self.values.items():
            graph.add_node(("v", *key), kind="value", shape=value.shape, dtype=value.dtype)
        for op in self.ops:
            graph.add_node(("op", op.index), kind="op", name=op.name)
            for pos, key in enumerate(op.inputs):
                if key is not None:
                    graph.add_edge(("v", *key), ("op", op.index), position=pos)
            for pos, key in enumerate(op.outputs):
                if key is not None:
                    graph.add_edge(("op", op.index), ("v", *key), position=pos)
        return graph

    def derived(
        self, shapes: Mapping[ValueKey, tuple[int, ...]] | None = None, attrs: Mapping[int, dict[str, Any]] | None = None
    ) -> ProgramGraph:
        """A new view of the same program with some values' shapes (``declared`` keeps the
        program's) and some ops' attributes replaced: how a rewrite that changes no op (one
        micro-batch's shapes, per-rank statistics) states its result without editing this one."""
        new = object.__new__(ProgramGraph)
        new.__dict__.update({k: v for k, v in self.__dict__.items() if k != "nx"})  # (nx: rebuilt on use)
        new.values = dict(self.values)
        for key, shape in (shapes or {}).items():
            old = self.values[key]
            new.values[key] = dataclasses.replace(old, shape=tuple(shape), declared=old.program_shape, users=old.users)
        new.ops = list(self.ops)
        for index, changed in (attrs or {}).items():
            new.ops[index] = dataclasses.replace(self.ops[index], attrs={**self.ops[index].attrs, **changed})
        new.view_shapes = {**self.view_shapes, **{key: tuple(shape) for key, shape in (shapes or {}).items()}}
        new.view_attrs = {index: {**self.view_attrs.get(index, {}), **(attrs or {}).get(index, {})} for index in {*self.view_attrs, *(attrs or {})}}
        return new

    # ---- queries ---------------------------------------------------------------------
    def key_of(self, value: Any) -> ValueKey | None:
        """The key of a PIR Value of this program (None if it belongs elsewhere)."""
        try:
            return self._by_impl.get(value.id)
        except (ValueError, AttributeError):
            return None

    def producer(self, key: ValueKey) -> OpNode:
        return self.ops[key[0]]

    def tensor_keys(self) -> Iterator[ValueKey]:
        return (k for k, v in self.values.items() if v.kind != "vector")

    def __len__(self) -> int:
        return len(self.ops)


def _constant_inputs(op: OpNode, values: dict[ValueKey, ValueNode]) -> Iterator[tuple[str, ValueKey]]:
    for label, key in zip(op.input_names, op.inputs):
        if key is not None and values[key].kind == "constant":
            yield label, key


def assign_roles(graph: ProgramGraph) -> None:
    """Forward / backward / optimizer roles, and each grad op's forward op.

    Backward: ``*_grad`` ops, and ops that read a gradient to make another gradient
    (accumulation, the loss-gradient seed feeding the first grad op). Optimizer: the update
    ops and the ops whose results only feed them (regularization, clipping).
    """
    grads: set[ValueKey] = set()
    first_grad = next((op.index for op in graph.ops if op.name.endswith("_grad")), None)
    if first_grad is None:
        return
    for op in graph.ops:
        if op.name in OPTIMIZER_OPS or op.attrs.get("op_role") == UPDATE_ROLE:
            op.role = Role.OPTIMIZER
            grads.update(k for k in op.outputs if k is not None)  # (a rewrite's update-phase gradient: clipping reads it)
        elif op.recomputes is not None or op.name.endswith("_grad") or (op.index > first_grad and any(k in grads for k in op.inputs)):
            op.role = Role.BACKWARD
            grads.update(k for k in op.outputs if k is not None)
    _seed_ops(graph, first_grad)
    _optimizer_feeders(graph)
    _link_forward_ops(graph)


SEED_OPS = ops_where("loss_seed")


def _seed_ops(graph: ProgramGraph, first_grad: int) -> None:
    """The constant ops just before the first grad op that only feed backward ops (the loss seed)."""
    for op in reversed(graph.ops[:first_grad]):
        if op.recomputes is not None:
            continue
        users = [u for k in op.outputs if k is not None for u in graph.values[k].users]
        if op.name not in SEED_OPS or not users or any(graph.ops[u].role is Role.FORWARD for u in users):
            break
        op.role = Role.BACKWARD


def _optimizer_feeders(graph: ProgramGraph) -> None:
    """Backward-made ops whose results only feed optimizer ops become optimizer ops (global-norm
    clipping's norms). A ``builtin.combine`` packing operands for its reader is not a reader
    (its vector has no users in the graph: the reader reads the members); it takes its
    reader's role."""
    for op in reversed(graph.ops):
        if op.role is Role.OPTIMIZER or op.name in SOURCE_OPS or op.name == "builtin.combine":
            continue
        users = [u for k in op.outputs if k is not None for u in graph.values[k].users if graph.ops[u].name != "builtin.combine"]
        if users and all(graph.ops[u].role is Role.OPTIMIZER for u in users) and op.role is Role.BACKWARD:
            if not op.name.endswith("_grad"):
                op.role = Role.OPTIMIZER
    first_grad = next((op.index for op in graph.ops if op.role is Role.BACKWARD), len(graph.ops))
    for op in graph.ops:
        # a combine packing forward values for a grad op (concat_grad's inputs) is part of the
        # backward: it takes its reader's role (it was FORWARD, and ran in the forward's phase)
        if op.name == "builtin.combine" and (op.role is Role.BACKWARD or op.index > first_grad):
            readers = [u for k in op.inputs if k is not None for u in graph.values[k].users if u > op.index and graph.ops[u].name != "builtin.combine"]
            if readers:
                op.role = graph.ops[min(readers)].role
        elif op.name == "builtin.split" and op.inputs and op.inputs[0] is not None:
            op.role = graph.ops[op.inputs[0][0]].role  # unpacks its producer's vector (concat_grad's gradients)


def _link_forward_ops(graph: ProgramGraph) -> None:
    """A grad op's forward op: the op of the matching name whose operands/results it reads most.

    Candidates are only the producers and forward users of the values the grad op reads, so
    linking stays linear in the program size.
    """
    for op in graph.ops:
        if not op.name.endswith("_grad"):
            continue
        names = (op.name[: -len("_grad")], op.name[: -len("_grad")] + "_")
        reads = {k for k in op.inputs if k is not None}
        near = {k[0] for k in reads} | {u for k in reads for u in graph.values[k].users}
        best, best_key = None, (0, 0)
        for index in sorted(near):
            fwd = graph.ops[index]
            origin = graph.ops[fwd.recomputes] if fwd.recomputes is not None else fwd  # a clone stands for its op
            if fwd.index >= op.index or origin.role is not Role.FORWARD or origin.name not in names:
                continue
            touched = {k for k in fwd.inputs if k} | {k for k in fwd.outputs if k}
            key = (len(reads & touched), origin.index)
            if key > best_key:
                best, best_key = origin, key
        op.forward_op = best.index if best is not None else None


def once_per_graph(find: Callable[[ProgramGraph], Any]) -> Callable[[ProgramGraph], Any]:
    """``find(graph)`` computed once per graph object and kept while the graph lives (every
    strategy compiled from one analysis asks the same questions of its graph). Keyed on the
    object, not its contents: a derived view (``ProgramGraph.derived``) is asked afresh. The
    result is shared: callers read it, never edit it."""
    found: weakref.WeakKeyDictionary[ProgramGraph, Any] = weakref.WeakKeyDictionary()

    @functools.wraps(find)
    def cached(graph: ProgramGraph) -> Any:
        result = found.get(graph)
        if result is None:
            result = found[graph] = find(graph)
        return result

    return cached


def copied_keys(mapping: Mapping[ValueKey, Any], copies: Mapping[int, int]) -> dict[ValueKey, Any]:
    """``mapping`` with the results of each copied op (``copies``: new op -> the op it copies)
    given what the results of the op it copies have."""
    by_op: dict[int, list[tuple[int, Any]]] = {}
    for (i, j), v in mapping.items():
        by_op.setdefault(i, []).append((j, v))
    out = dict(mapping)
    for new, source in copies.items():
        out.update({(new, j): v for j, v in by_op.get(source, ())})
    return out
