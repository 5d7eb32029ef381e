"""``autopar.local_map``: a function run per rank on its shards, with a serial meaning (stage: annotate).

``local_map(fn, in_placements, out_placements, mesh)(*inputs)`` (Paddle's ``LocalLayer``,
torch's ``local_map``) builds, in the static program, what ``fn`` means when each rank runs it on
its own shards: each input placed ``in_placements`` on ``mesh`` is split into its shards along
the mesh dims that shard it (an input replicated over them is read whole by every copy), ``fn``
is called once per shard — the ops of copy ``j`` placed on the sub-mesh of the ranks holding
shard ``j`` — and each output is assembled by its ``out_placements``: ``Shard(d)`` outputs
concatenated along ``d``, ``Partial()`` outputs summed. That program IS the serial meaning: run
serially it applies ``fn`` to each shard in turn and assembles the results, so "distributed =
serial" holds exactly (a router's statistics per group of tokens, in the reference too).

Compiled, nothing moves: each rank keeps only its copy, the splits and the assembly are views
(a rank's shard IS its piece, autopar/sub_meshes.py). :func:`sub_mesh_tensors` and
:func:`global_mesh_tensor` are the two halves (Paddle's ``moe_sub_mesh_tensors`` /
``moe_global_mesh_tensor``): experts written per sub-mesh, their parameters placed on
``split_mesh(mesh, "ep")[i]``, read and return the expert buffer through them.

Under a pipeline of ``m`` micro-batches, the ranks run ``fn`` on each micro-batch's shards; the
serial meaning above applies it to the whole batch's. The two agree where ``groups`` (a multiple of
``m``) makes each copy's rows whole groups of each micro-batch (:func:`local_map`); without it,
micro-batching refuses the region by name (one micro-batch is exact).

Refused by name: a placement that leaves a pending sum on an input (``Partial``: a shard has no
piece of it), a shard that does not divide its dim, outputs whose copies disagree in shape.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from autopar.annotate import program_of, record, shard_tensor, to_dist_attr, value_label
from autopar.dist_attr import DistAttr
from autopar.errors import AnnotationError
from autopar.mesh import ProcessMesh, not_a_mesh
from autopar.sub_meshes import piece, split_mesh, sub_mesh_at

__all__ = ["global_mesh_tensor", "local_map", "split_mesh", "sub_mesh_tensors"]


def _dims(mesh: ProcessMesh, dims: str | Sequence[str]) -> tuple[int, ...]:
    names = [dims] if isinstance(dims, str) else list(dims)
    return tuple(mesh.mesh_dim(n) for n in names)


def sub_meshes(mesh: ProcessMesh, dims: Sequence[int]) -> list[ProcessMesh]:
    """The sub-meshes of ``mesh`` at every coordinate of ``dims`` (the first the major digit)."""
    out = [{}]
    for d in dims:
        out = [{**c, d: i} for c in out for i in range(mesh.shape[d])]
    return [sub_mesh_at(mesh, c) for c in out]


def _attr(value: Any, mesh: ProcessMesh, placements: Any) -> DistAttr:
    return to_dist_attr(placements, mesh, len(value.shape), value_label(value))


def _split_dim(attr: DistAttr, dims: tuple[int, ...], what: str) -> int | None:
    """The tensor dim ``attr`` splits over ``dims`` outermost, in order (None: replicated over them)."""
    if any(d in dims for d, _ in attr.partial):
        raise AnnotationError(f"{what} is pending a sum over {[attr.mesh.dim_names[d] for d in dims]}: a shard has no piece of it")
    for tensor_dim, split in enumerate(attr.mapping):
        if set(split) & set(dims):
            if tuple(split[: len(dims)]) != dims:
                names = [attr.mesh.dim_names[d] for d in dims]
                raise AnnotationError(f"{what}: {attr} must split one dim over {names} outermost, in that order")
            return tensor_dim
    return None


def sub_mesh_tensors(value: Any, mesh: ProcessMesh, placements: Any, dims: str | Sequence[str]) -> list[Any]:
    """The pieces of ``value`` (placed ``placements`` on ``mesh``) held by each sub-mesh along
    ``dims`` (Paddle's ``moe_sub_mesh_tensors``): piece ``j`` on the ``j``-th sub-mesh, placed
    there as ``value``'s shard is. In the program: a ``split`` (a view once compiled)."""
    import paddle

    order = _dims(mesh, dims)
    attr = _attr(value, mesh, placements)
    label = value_label(value)
    axis = _split_dim(attr, order, f"sub_mesh_tensors of {label!r}")
    subs = sub_meshes(mesh, order)
    if axis is None:
        raise AnnotationError(f"sub_mesh_tensors of {label!r}: {attr} does not split it over {list(dims) if not isinstance(dims, str) else dims}")
    size = value.shape[axis]
    if size % len(subs):
        raise AnnotationError(f"sub_mesh_tensors of {label!r}: dim {axis} ({size}) does not divide into {len(subs)} shards")
    # (``value`` itself keeps what its op makes: the split reads it lined up with the pieces,
    # resharded right before the split where it is not)
    pieces = paddle.split(value, len(subs), axis=axis)
    for sub, part in zip(subs, pieces):
        shard_tensor(part, sub, piece(attr, order, sub))
    return list(pieces)


def global_mesh_tensor(pieces: Sequence[Any], mesh: ProcessMesh, placements: Any, dims: str | Sequence[str]) -> Any:
    """The value on ``mesh`` placed ``placements`` whose shards along ``dims`` are ``pieces``
    (piece ``j`` on the ``j``-th sub-mesh; Paddle's ``moe_global_mesh_tensor``): concatenated along
    the dim ``placements`` split over ``dims``, or summed where they are ``Partial`` over them."""
    import paddle

    order = _dims(mesh, dims)
    subs = sub_meshes(mesh, order)
    if len(pieces) != len(subs):
        raise AnnotationError(f"global_mesh_tensor: {len(pieces)} pieces for the {len(subs)} sub-meshes of {mesh} along {dims}")
    shapes = {tuple(p.shape) for p in pieces}
    if len(shapes) != 1:
        raise AnnotationError(f"global_mesh_tensor: the pieces' shapes differ ({sorted(shapes)})")
    ndim = len(pieces[0].shape)
    attr = to_dist_attr(placements, mesh, ndim, "global_mesh_tensor")
    summed = all((d, "sum") in attr.partial for d in order)
    axis = None if summed else _split_dim(attr, order, "global_mesh_tensor")
    if axis is None and not summed:
        raise AnnotationError(f"global_mesh_tensor: {attr} neither splits a dim over {dims} nor sums over it (Partial)")
    for sub, part in zip(subs, pieces):
        shard_tensor(part, sub, piece(attr, order, sub))
    whole = paddle.add_n(list(pieces)) if summed else paddle.concat(list(pieces), axis=axis)
    return shard_tensor(whole, mesh, attr)


@contextlib.contextmanager
def _placed_on(sub: ProcessMesh) -> Iterator[None]:
    """Every op built inside runs on ``sub`` (not a pipeline stage: ``local_ops``)."""
    import paddle

    program = paddle.static.default_main_program()
    before = {op.id() for op in program.global_block().ops}
    yield
    table = record(program).local_ops
    for op in program.global_block().ops:
        if op.id() not in before:
            table[op.id()] = sub


def _grouped(attr: DistAttr) -> DistAttr:
    """``attr`` for the value with a leading groups dim put before its dim 0 (unsplit)."""
    return DistAttr.of(attr.mesh, ((), *attr.mapping), attr.partial)


def local_map(
    fn: Callable[..., Any], in_placements: Sequence[Any], out_placements: Sequence[Any], mesh: ProcessMesh, groups: int = 1
) -> Callable[..., Any]:  # fmt: skip
    """``fn`` run per rank on its shards (module docstring). ``in_placements`` / ``out_placements``:
    one Paddle placement list (one entry per mesh dim) per input / output of ``fn``; the mesh dims
    that shard any input are the copies' (every input sharding a dim over them does so over all
    of them, outermost, in mesh order). Returns a function of the inputs; an ``fn`` returning one
    value gives one value.

    ``groups`` (the per-micro-batch opt-in, docs/moe.md): each copy runs ``fn`` on ``groups``
    groups of rows at once, over a new leading dim that ``fn`` keeps (a router over ``[groups,
    tokens, dim]`` routes each group on its own). The split dim (dim 0) of each input is read
    group-major, ``[groups, copies, rows]``: copy ``j`` gets the ``j``-th piece of every group.
    Under ``m`` micro-batches with ``m`` dividing ``groups``, each micro-batch holds whole groups,
    and the ranks run exactly what the serial program does. ``Shard(0)`` outputs come back in the
    inputs' row order (``fn``'s results ``[groups, rows, ...]``), ``Partial()`` ones summed."""
    if not isinstance(mesh, ProcessMesh):
        raise AnnotationError(not_a_mesh("local_map", mesh))
    if not callable(fn):
        raise AnnotationError(f"local_map needs a function, got {type(fn).__name__}")
    if not isinstance(groups, int) or groups < 1:
        raise AnnotationError(f"local_map({getattr(fn, '__name__', 'fn')}): groups is a positive int, got {groups!r}")

    @functools.wraps(fn)
    def mapped(*inputs: Any) -> Any:
        name = getattr(fn, "__name__", "fn")
        if len(inputs) != len(in_placements):
            raise AnnotationError(f"local_map({name}): {len(inputs)} inputs, {len(in_placements)} in_placements")
        program_of(inputs[0])
        attrs = [_attr(x, mesh, p) for x, p in zip(inputs, in_placements)]
        order = tuple(sorted({d for a in attrs for split in a.mapping for d in split} | {d for a in attrs for d, _ in a.partial}))
        if not order:
            raise AnnotationError(f"local_map({name}): no input is split over a mesh dim: there is one shard")
        names = [mesh.dim_names[d] for d in order]
        copies = len(sub_meshes(mesh, order))
        pieces = []
        for x, a in zip(inputs, attrs):
            axis = _split_dim(a, order, f"local_map input {value_label(x)!r}")
            if axis is None:
                pieces.append([x] * copies)
                continue
            if groups > 1:  # group-major: [groups, rows of every copy], each copy's piece [groups, its rows]
                if axis != 0 or x.shape[0] % groups:
                    raise AnnotationError(
                        f"local_map({name}, groups={groups}): input {value_label(x)!r} {list(x.shape)} is split on dim {axis}; "
                        f"groups take dim 0 apart, which {groups} must divide"
                    )
                x, a = x.reshape([groups, x.shape[0] // groups, *x.shape[1:]]), _grouped(a)
            pieces.append(sub_mesh_tensors(x, mesh, a, names))
        outputs = []
        for j, sub in enumerate(sub_meshes(mesh, order)):
            with _placed_on(sub):
                out = fn(*[p[j] for p in pieces])
            outputs.append(list(out) if isinstance(out, (list, tuple)) else [out])
        if any(len(o) != len(out_placements) for o in outputs):
            raise AnnotationError(f"local_map({name}): fn returns {len(outputs[0])} values, {len(out_placements)} out_placements")
        joined = []
        for i, placements in enumerate(out_placements):
            parts = [o[i] for o in outputs]
            if groups == 1:
                joined.append(global_mesh_tensor(parts, mesh, placements, names))
                continue
            ndim = len(parts[0].shape)
            attr = to_dist_attr(placements, mesh, ndim, f"local_map({name}) output {i}")  # (on fn's results)
            summed = all((d, "sum") in attr.partial for d in order)
            axis = None if summed else _split_dim(attr, order, f"local_map({name}) output {i}")
            if axis is None:  # a sum over the copies
                joined.append(global_mesh_tensor(parts, mesh, attr, names))
                continue
            if axis != 0 or ndim < 2 or parts[0].shape[0] != groups or attr.mapping[-1]:
                raise AnnotationError(
                    f"local_map({name}, groups={groups}): output {i} {list(parts[0].shape)} placed {attr}: with groups, fn's "
                    "results lead with the groups dim, and a split output is Shard(0) (its rows)"
                )
            attr = DistAttr.of(mesh, ((), *attr.mapping[:-1]), attr.partial)  # (its rows: dim 1 of fn's [groups, rows, ...])
            whole = global_mesh_tensor(parts, mesh, attr, names)  # [groups, rows of every copy, ...]
            joined.append(whole.reshape([whole.shape[0] * whole.shape[1], *whole.shape[2:]]))
        return joined[0] if len(joined) == 1 else tuple(joined)

    return mapped
