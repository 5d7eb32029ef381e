"""Sub-meshes that are not pipeline stages (stage: annotate -> propagate).

A sub-mesh of the compile mesh fixes the coordinates of some of its dims: ``split_mesh(mesh,
"ep")[i]`` is the ranks at ``ep == i``, keeping the other dims (Paddle's ``split_mesh``; ``mesh[i]``
is the same thing for the first dim). A value placed there is held by those ranks only, and an op
whose inputs live there runs there (an expert's layers, one copy of an ``autopar.local_map``).

Values cross between the mesh and its sub-meshes only where no data moves:

- a value on the mesh *replicated* over the fixed dims is read on a sub-mesh as it is (each rank
  of the sub-mesh holds it already: :func:`restricted`);
- a ``split`` (or ``concat_grad``) of a value into as many equal pieces as the fixed dims have
  shards, piece ``j`` placed on the sub-mesh holding shard ``j`` — the value split along that dim
  over the fixed dims, outermost — is a *view*: a rank's piece IS its local value;
- a ``concat`` of such pieces is the same view the other way (the result split over the fixed
  dims), and a sum of them (``add_n``, ``add``) leaves the result pending a sum over them
  (``Partial``) — each rank holds its own term.

Under a pipeline (stages along dim 0), a sub-mesh that keeps the pipeline dim stands, on each
stage, for its ranks there (:func:`within_stage`: ``split_mesh(mesh, "ep")[i]`` on ``pp x ep`` is
``mesh[s]`` at ``ep == i`` on stage ``s``): the stages are cut first, then each op is placed with
its stage mesh standing for the mesh, and views join or split the pieces of a stage's value
(:func:`onto_stage_sub_meshes`).

:func:`place_ops` finds where each op runs, :func:`find_views` the views; propagation asks
:func:`view_result` for a view's placements instead of a rule; the sub_meshes pass
(``passes/sub_meshes.py``) keeps on each rank its own ops and turns views into plain reads.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autopar.annotate import local_op_ids
from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.graph import VECTOR_OPS, OpNode, ProgramGraph, ValueKey
from autopar.mesh import ProcessMesh
from autopar.op_kinds import SOURCE_OPS
from autopar.spmd import RuleResult, ops_where, trait_values

SPLITS = ops_where("splits_pieces")  # split, split_with_num, concat_grad: a tensor taken apart into equal pieces
JOINS = ops_where("joins_pieces")  # concat (and split's grad), add_n, add: pieces put together
_SUMS = {name for name, how in trait_values("joins_pieces").items() if how == "sum"}


# ---- meshes -----------------------------------------------------------------------------------
def local_region_ops(graph: ProgramGraph) -> set[int]:
    """The ops ``autopar.local_map`` placed in its copies, with their grad ops, by index (found
    by the user's op ids: ``graph.op_aliases`` after a serial rewrite)."""
    ids = local_op_ids()
    if not ids:
        return set()
    by_id = {op.op_id: op.index for op in graph.ops} | graph.op_aliases
    found = {by_id[i] for i in ids if i in by_id}
    return found | {op.index for op in graph.ops if op.forward_op in found}


def split_mesh(mesh: ProcessMesh, dim: str | int) -> list[ProcessMesh]:
    """The sub-meshes of ``mesh`` along ``dim``, one per coordinate (Paddle's ``split_mesh``)."""
    mesh_dim = mesh.mesh_dim(dim)
    return [sub_mesh_at(mesh, {mesh_dim: i}) for i in range(mesh.shape[mesh_dim])]


def sub_mesh_at(mesh: ProcessMesh, coordinates: Mapping[int, int]) -> ProcessMesh:
    """The ranks of ``mesh`` at ``coordinates`` (mesh dim -> coordinate), keeping the other dims
    (none left: a one-rank mesh named by the last fixed dim, as ``mesh[i]`` of a 1-d mesh)."""
    ranks = [r for r in mesh.ranks if all(mesh.coordinate(r)[d] == c for d, c in coordinates.items())]
    kept = [d for d in range(mesh.ndim) if d not in coordinates]
    if not kept:
        return ProcessMesh(ranks, [mesh.dim_names[max(coordinates)]])
    return ProcessMesh(shape=[mesh.shape[d] for d in kept], process_ids=ranks, dim_names=[mesh.dim_names[d] for d in kept])


def fixed_coordinates(mesh: ProcessMesh, sub: ProcessMesh) -> dict[int, int] | None:
    """The dims of ``mesh`` (of size > 1) that ``sub`` fixes and their coordinates; None when
    ``sub`` is not such a sub-mesh ({} for the mesh itself)."""
    spanning = {name: size for name, size in zip(sub.dim_names, sub.shape) if size > 1}
    if any(name not in mesh.dim_names or mesh.dim_size(name) != size for name, size in spanning.items()):
        return None
    if not sub.ranks or sub.ranks[0] not in mesh.ranks:
        return None
    first = mesh.coordinate(sub.ranks[0])
    fixed = {d: first[d] for d in range(mesh.ndim) if mesh.shape[d] > 1 and mesh.dim_names[d] not in spanning}
    return fixed if sub_mesh_at(mesh, fixed).ranks == sub.ranks else None


def is_sub_mesh(mesh: ProcessMesh, sub: ProcessMesh) -> bool:
    """``sub`` is a proper sub-mesh of ``mesh`` that fixes some of its dims."""
    return bool(fixed_coordinates(mesh, sub))


# ---- placements -------------------------------------------------------------------------------
def _by_name(dist: DistAttr, target: ProcessMesh, drop: set[int]) -> DistAttr:
    """``dist`` re-expressed on ``target`` by dim name, the mesh dims ``drop`` left out."""
    index = {d: target.dim_names.index(dist.mesh.dim_names[d]) for d in range(dist.mesh.ndim) if d not in drop}
    mapping = tuple(tuple(index[d] for d in dims if d not in drop) for dims in dist.mapping)
    partial = tuple((index[d], k) for d, k in dist.partial if d not in drop)
    return DistAttr.of(target, mapping, partial)


def restricted(dist: DistAttr, sub: ProcessMesh) -> DistAttr | None:
    """``dist`` (on a mesh) read on its sub-mesh ``sub`` with no data moved: the dims ``sub``
    fixes must neither split it nor hold a pending reduction (None otherwise)."""
    fixed = fixed_coordinates(dist.mesh, sub)
    if fixed is None:
        return None
    used = {d for dims in dist.mapping for d in dims} | {d for d, _ in dist.partial}
    return None if used & set(fixed) else _by_name(dist, sub, set(fixed))


def _order(mesh: ProcessMesh, subs: Sequence[ProcessMesh]) -> tuple[int, ...] | None:
    """The fixed dims of ``subs`` in the order whose mixed radix numbers them 0, 1, ... (every
    coordinate once); None when they are not the shards of one set of dims."""
    coordinates = [fixed_coordinates(mesh, sub) for sub in subs]
    if not coordinates or any(not c for c in coordinates) or len({tuple(sorted(c)) for c in coordinates}) != 1:
        return None
    dims = sorted(coordinates[0])
    if len(subs) != _count(mesh, dims):
        return None
    for order in itertools.permutations(dims):
        if all(_radix(mesh, order, c) == j for j, c in enumerate(coordinates)):
            return order
    return None


def _count(mesh: ProcessMesh, dims: Sequence[int]) -> int:
    out = 1
    for d in dims:
        out *= mesh.shape[d]
    return out


def _radix(mesh: ProcessMesh, order: Sequence[int], coordinates: Mapping[int, int]) -> int:
    index = 0
    for d in order:
        index = index * mesh.shape[d] + coordinates[d]
    return index


def lined_up(dist: DistAttr, order: Sequence[int], axis: int | None) -> DistAttr:
    """``dist`` with the mesh dims ``order`` moved to split tensor dim ``axis`` outermost, in that
    order (``axis`` None: pending a sum over them) — the placement whose shards are the pieces."""
    fixed = set(order)
    mapping = [tuple(d for d in dims if d not in fixed) for dims in dist.mapping]
    partial = [(d, k) for d, k in dist.partial if d not in fixed]
    if axis is None:
        partial += [(d, "sum") for d in order]
    else:
        mapping[axis] = tuple(order) + mapping[axis]
    return DistAttr.of(dist.mesh, tuple(mapping), tuple(sorted(partial)))


def piece(dist: DistAttr, order: Sequence[int], sub: ProcessMesh) -> DistAttr:
    """The placement on ``sub`` of the piece of ``dist`` (lined up over ``order``) it holds."""
    return _by_name(dist, sub, set(order))


def joined(piece_dist: DistAttr, mesh: ProcessMesh, order: Sequence[int], axis: int | None) -> DistAttr:
    """The placement on ``mesh`` of pieces placed ``piece_dist`` on the sub-meshes of ``order``,
    concatenated along ``axis`` (None: summed)."""
    index = {d: mesh.dim_names.index(piece_dist.mesh.dim_names[d]) for d in range(piece_dist.mesh.ndim) if piece_dist.mesh.shape[d] > 1}
    mapping = tuple(tuple(index[d] for d in dims) for dims in piece_dist.mapping)
    partial = tuple((index[d], k) for d, k in piece_dist.partial)
    return lined_up(DistAttr.of(mesh, mapping, partial), order, axis)


# ---- where ops run, and the views -------------------------------------------------------------
@dataclass(frozen=True)
class View:
    """An op that only moves a value between the mesh and the sub-meshes of its shards: a
    ``split`` (the pieces are outputs) or a join (``concat``: along ``axis``; a sum: ``axis`` None)."""

    op: int
    splits: bool
    whole: int  # the op's input (split) or output (join) position of the whole value
    pieces: tuple[int, ...]  # the op's output (split) or input (join) positions of the pieces
    meshes: tuple[ProcessMesh, ...]  # each piece's sub-mesh
    order: tuple[int, ...]  # the fixed mesh dims of ``mesh``, outermost first
    axis: int | None
    mesh: ProcessMesh | None = None  # the whole value's mesh: the compile mesh, or a pipeline stage's


def _axis(op: OpNode, ndim: int) -> int:
    axis = op.attrs.get("axis", 0)
    axis = int(axis[0] if isinstance(axis, (list, tuple)) else axis)
    return axis % ndim if ndim else 0


def place_ops(
    graph: ProgramGraph, mesh: ProcessMesh, user: Mapping[ValueKey, DistAttr], placed: Mapping[int, ProcessMesh],
    homes: Mapping[int, ProcessMesh] | None = None,
) -> dict[int, ProcessMesh]:  # fmt: skip
    """``placed`` plus the sub-mesh each op runs on when its inputs live on one (grad ops: their
    forward op's), and its home mesh for an op joining values of several sub-meshes (a view, or
    refused by propagation). ``homes``: under a pipeline, the stage mesh each forward op runs on
    (the cut's); an op's sub-meshes are then those of its stage, and ops placed on no sub-mesh
    keep their stage. Without any sub-mesh placement: ``placed`` (and ``homes``) unchanged."""
    homes = homes or {}
    where: dict[ValueKey, ProcessMesh] = {k: a.mesh for k, a in user.items()}
    if not any(is_sub_mesh(mesh, m) for m in (*where.values(), *placed.values())):
        return {**homes, **placed}

    def home(op: OpNode) -> ProcessMesh:
        """The op's stage (a grad op: its forward op's; one without: the stage its inputs live
        on, when one); without a pipeline, the mesh."""
        found = homes.get(op.index)
        if found is None and op.forward_op is not None:
            found = homes.get(op.forward_op)
        if found is None and homes:
            stages = {stage_container(mesh, where[k]) for k in op.inputs if k is not None and k in where}
            found = stages.pop() if len(stages) == 1 else None
        return found or mesh

    out = dict(placed)
    for op in graph.ops:
        if op.name in VECTOR_OPS or op.name in SOURCE_OPS:
            continue
        whole = home(op)
        found = out.get(op.index)
        if found is None and op.forward_op is not None:
            found = out.get(op.forward_op)
        if found is None:
            subs = list(dict.fromkeys(where[k] for k in op.inputs if k is not None and k in where and is_sub_mesh(whole, where[k])))
            found = subs[0] if len(subs) == 1 else (whole if subs else None)
            if found is None and op.name in SPLITS and any(is_sub_mesh(whole, where.get(k, whole)) for k in op.outputs if k is not None):
                found = whole  # a split whose pieces are placed on sub-meshes (autopar.sub_mesh_tensors)
            if found is not None:
                out[op.index] = found
        elif op.index not in out:
            out[op.index] = found
        if found is None:
            continue
        forward = graph.ops[op.forward_op] if op.forward_op is not None else None
        for j, key in enumerate(op.outputs):
            if key is None:
                continue
            if found == whole and op.name in SPLITS and forward is not None and op.name.endswith("_grad"):
                pieces = [k for k in forward.inputs if k is not None and graph.values[k].kind != "constant"]
                if j < len(pieces) and pieces[j] in where:  # concat_grad: each gradient where its piece is
                    where.setdefault(key, where[pieces[j]])
                    continue
            where.setdefault(key, found)
    ops_meshes = {**homes, **out}
    for op in graph.ops:  # a plain split whose pieces are each read on the sub-mesh of its shard
        if op.name in SPLITS and op.forward_op is None and op.index not in out:
            whole = home(op)
            meshes = [readers_mesh(graph, k, ops_meshes) for k in op.outputs if k is not None]
            if all(m is not None and is_sub_mesh(whole, m) for m in meshes) and _order(whole, meshes) is not None:  # type: ignore[arg-type]
                out[op.index] = whole
    return {**homes, **out}


def readers_mesh(graph: ProgramGraph, key: ValueKey, op_meshes: Mapping[int, ProcessMesh]) -> ProcessMesh | None:
    """The one mesh every reader of ``key`` runs on (None: readers on several, or unplaced)."""
    found = {op_meshes.get(user) for user in graph.values[key].users}
    return found.pop() if len(found) == 1 else None


def value_meshes(
    graph: ProgramGraph, mesh: ProcessMesh, user: Mapping[ValueKey, DistAttr], op_meshes: Mapping[int, ProcessMesh]
) -> dict[ValueKey, ProcessMesh]:  # fmt: skip
    """Where each value lives before propagation: its annotation's mesh, else its op's — the
    pieces of a split on ``mesh`` where their readers run, when that is one sub-mesh."""
    where = {k: a.mesh for k, a in user.items()}
    for index, op_mesh in op_meshes.items():
        op = graph.ops[index]
        for key in op.outputs:
            if key is None or key in where:
                continue
            readers = readers_mesh(graph, key, op_meshes) if op.name in SPLITS else None
            where[key] = readers if readers is not None and is_sub_mesh(op_mesh, readers) else op_mesh
    return where


def find_views(graph: ProgramGraph, mesh: ProcessMesh, where: Mapping[ValueKey, ProcessMesh], op_meshes: Mapping[int, ProcessMesh]) -> dict[int, View]:
    """The views of the program (module docstring) by op index: ops on ``mesh`` (or, under a
    pipeline, on a stage mesh) of the split / join kinds whose pieces live on sub-meshes of the
    op's mesh (``where``: each value's mesh). A join of values of several sub-meshes that is no
    view is refused."""
    if not any(is_sub_mesh(mesh, m) for m in {*op_meshes.values(), *where.values()}):
        return {}
    views: dict[int, View] = {}
    for op in graph.ops:
        whole_mesh = op_meshes.get(op.index)
        if whole_mesh is None:
            continue
        tensors = [p for p, k in enumerate(op.inputs) if k is not None and graph.values[k].kind != "constant"]
        if op.name in SPLITS:
            whole = tensors[-1] if op.name.endswith("_grad") else tensors[0]  # concat_grad: (x[0..n-1], out_grad)
            slots = tuple(p for p, k in enumerate(op.outputs) if k is not None)
            keys = [op.outputs[p] for p in slots]
            ndim = len(graph.values[op.inputs[whole]].shape)
        elif op.name in JOINS:
            whole, slots = 0, tuple(tensors)
            keys = [op.inputs[p] for p in slots]
            ndim = len(graph.values[op.outputs[0]].shape)
        else:
            continue
        if op.name in SPLITS and op.forward_op is not None:  # concat_grad: each gradient where its piece is
            forward = graph.ops[op.forward_op]
            keys = [k for k in forward.inputs if k is not None and graph.values[k].kind != "constant"][: len(keys)]
        meshes = [where.get(k) for k in keys]
        if not any(m is not None and is_sub_mesh(whole_mesh, m) for m in meshes):
            continue
        order = _order(whole_mesh, meshes) if all(m is not None for m in meshes) else None
        if order is None:
            raise AutoparError(
                f"{op} joins or splits values of the sub-meshes {', '.join(str(m) for m in meshes)} of {whole_mesh}: the pieces "
                "must be one per shard of the sub-meshes' dims, in order (split_mesh(mesh, dim)[i] holds piece i)"
            )
        axis = None if op.short_name in _SUMS else _axis(op, ndim)
        views[op.index] = View(op.index, op.name in SPLITS, whole, slots, tuple(meshes), order, axis, whole_mesh)  # type: ignore[arg-type]
    for op in graph.ops:  # any other op reading several sub-meshes' values
        op_mesh = op_meshes.get(op.index)
        if op.index in views or op_mesh is None or op.name in VECTOR_OPS:
            continue
        subs = {where[k] for k in op.inputs if k is not None and k in where and is_sub_mesh(op_mesh, where[k])}
        if subs:
            raise AutoparError(
                f"{op} runs on {op_mesh} but reads values held by its sub-meshes {', '.join(map(str, subs))} only; join "
                "them first (autopar.global_mesh_tensor, or the out_placements of autopar.local_map)"
            )
    return views


def view_result(view: View, op: OpNode, mesh: ProcessMesh, known: Mapping[ValueKey, DistAttr]) -> RuleResult | None:
    """A view's placements from what is ``known`` of its whole value or, else, of a piece: the
    whole lined up with the pieces (a reshard on the mesh where it is not), each piece its
    shard. None while nothing is known."""
    whole_key = op.inputs[view.whole] if view.splits else op.outputs[view.whole]
    piece_keys = [(op.outputs if view.splits else op.inputs)[p] for p in view.pieces]
    mesh = view.mesh or mesh
    whole = known.get(whole_key)
    if whole is not None and whole.mesh == mesh:
        lined = lined_up(whole, view.order, view.axis)
    else:
        first = next(((k, known[k]) for k in piece_keys if k in known), None)
        if first is None:
            return None
        lined = joined(first[1], mesh, view.order, view.axis)
    pieces = [piece(lined, view.order, sub) for sub in view.meshes]
    if view.splits:
        inputs = [None] * len(op.inputs)
        inputs[view.whole] = lined
        outputs: list[DistAttr | None] = [None] * len(op.outputs)
        for slot, placed in zip(view.pieces, pieces):
            outputs[slot] = placed
        return RuleResult(tuple(inputs), tuple(outputs))
    inputs = [None] * len(op.inputs)
    for slot, placed in zip(view.pieces, pieces):
        inputs[slot] = placed
    outputs = [None] * len(op.outputs)
    outputs[view.whole] = lined
    return RuleResult(tuple(inputs), tuple(outputs))


# ---- under a pipeline: sub-meshes of the stages ------------------------------------------------
def spans_stages(mesh: ProcessMesh, sub: ProcessMesh) -> bool:
    """``sub`` is a sub-mesh of a pipelined ``mesh`` (stages along dim 0) that keeps the pipeline
    dim: it fixes other dims only (``split_mesh(mesh, "ep")[i]`` on a ``pp x ep`` mesh), so on
    each stage it stands for its ranks there."""
    fixed = fixed_coordinates(mesh, sub)
    return bool(fixed) and 0 not in fixed and mesh.shape[0] > 1


def within_stage(mesh: ProcessMesh, sub: ProcessMesh, stage: ProcessMesh) -> ProcessMesh:
    """The ranks of ``sub`` (a sub-mesh of ``mesh`` keeping its pipeline dim) on ``stage``: the
    sub-mesh of ``stage`` fixing the same dims, by name, at the same coordinates."""
    fixed = fixed_coordinates(mesh, sub) or {}
    return sub_mesh_at(stage, {stage.dim_names.index(mesh.dim_names[d]): c for d, c in fixed.items()})


def onto_stage_sub_meshes(
    graph: ProgramGraph, mesh: ProcessMesh, user: Mapping[ValueKey, DistAttr], cut: Mapping[int, ProcessMesh],
    local: Mapping[int, ProcessMesh],
) -> tuple[dict[ValueKey, DistAttr], dict[int, ProcessMesh]]:  # fmt: skip
    """Under a pipeline, values and ops placed on sub-meshes that keep the pipeline dim (an
    ``autopar.local_map``'s copies, ``local``; experts annotated on ``split_mesh(mesh, "ep")[i]``)
    read as living on the sub-mesh of their stage (:func:`within_stage`). A local region (its
    copies, one run of ops) runs on one stage: the latest the pipeline's ``cut`` gives its ops
    (a cut falling between copies moves the earlier ones after it), and the split handing it its
    pieces runs there too. An activation lives on its producer's stage, a parameter on its first
    forward reader's. Then every op is placed as without a pipeline, its stage mesh standing for
    the mesh (:func:`place_ops`); a parameter the copies read, unannotated, is held whole by their
    stage. Returns the user's placements and the op meshes so moved."""
    homes = dict(cut)
    order = {mesh[i]: i for i in range(mesh.shape[0])}
    for region in _runs(sorted(local)):
        stages = [homes[i] for i in region if i in homes]
        if not stages:
            raise AutoparError(f"{graph.ops[region[0]]} (an autopar.local_map copy on {local[region[0]]}) runs on no pipeline stage")
        latest = max(stages, key=order.__getitem__)
        homes.update({i: latest for i in region})
        for key, attr in user.items():  # the split handing the region its pieces: on the region's stage
            if graph.values[key].kind == "activation" and spans_stages(mesh, attr.mesh) and key[0] not in local:
                if any(u in region for u in graph.values[key].users):
                    for maker in (key[0], *(k[0] for k in graph.ops[key[0]].inputs if k is not None and graph.ops[key[0]].name in VECTOR_OPS)):
                        homes[maker] = latest
    placed = {i: within_stage(mesh, sub, homes[i]) for i, sub in local.items()}
    moved = dict(user)
    for key, attr in user.items():
        if not spans_stages(mesh, attr.mesh):
            continue
        value = graph.values[key]
        pipeline_dim = attr.mesh.dim_names.index(mesh.dim_names[0])
        if pipeline_dim in attr.sharded_mesh_dims() or pipeline_dim in attr.partial_dims:
            raise AutoparError(f"{value.label!r} is placed {attr}, split over the pipeline dim {mesh.dim_names[0]!r}; each stage holds it whole")
        stages = [homes[key[0]]] if value.kind == "activation" and key[0] in homes else [homes[u] for u in value.users if u in homes]
        if not stages:
            raise AutoparError(f"{value.label!r} is placed on {attr.mesh}, but no op of a pipeline stage makes or reads it")
        moved[key] = _by_name(attr, within_stage(mesh, attr.mesh, stages[0]), {pipeline_dim})
    for key, value in graph.values.items():  # an unannotated parameter the copies read: held whole by their stage
        readers = [u for u in value.users if u in local]
        if value.kind == "parameter" and key not in moved and readers:
            moved[key] = DistAttr.replicated(homes[readers[0]], len(value.shape))
    cut_homes = {i: m for i, m in homes.items() if i not in local}
    return moved, place_ops(graph, mesh, moved, placed, homes=cut_homes)


def _runs(indices: Sequence[int]) -> list[list[int]]:
    """``indices`` (sorted) in maximal runs of consecutive ones: the ops of one local region."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def stage_container(mesh: ProcessMesh, sub: ProcessMesh) -> ProcessMesh:
    """The pipeline stage ``mesh[i]`` holding ``sub`` when ``sub`` is a sub-mesh of that stage
    (it fixes the pipeline dim and more: an expert's ranks on a stage); else ``sub``."""
    fixed = fixed_coordinates(mesh, sub)
    if fixed and 0 in fixed and len(fixed) > 1 and mesh.ndim > 1:
        return mesh[fixed[0]]
    return sub
