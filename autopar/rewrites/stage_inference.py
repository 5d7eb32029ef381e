"""Pipeline stages inferred as Paddle infers them (stage: rewrite, part of stage inference).

Paddle's semi-auto users place stages without wrapping layers: they annotate each layer's
parameters on its stage's sub-mesh (``dist.shard_tensor(w, mesh[i], ...)``), move activations
between stages with ``dist.reshard(h, mesh[i + 1], ...)``, and every op runs on the mesh its
inputs live on. So here: a forward op no ``shard_op`` placed runs on the stage mesh of its
inputs — a parameter's or feed's annotation, the mesh of the op that made an activation — and,
when its inputs live on several stages, on the latest of them in pipeline order (the earlier
ones are sent forward, as a reshard would). Ops reading only constants stay unplaced (they are
computed on every stage reading them: :mod:`.stage_constants`); backward and optimizer ops
follow their forward ops later (the pipeline split).

Glue a model writes in its own forward, outside any layer, may read no staged value at all (a
ViT's ``cls_token.expand((paddle.shape(x)[0], -1, -1))`` reads an unannotated parameter and
constants): such an op runs on the stage of its readers, the earliest when several
(:func:`reader_stages`), where the value is first needed.
"""

from __future__ import annotations

from collections.abc import Mapping

from autopar.dist_attr import DistAttr
from autopar.graph import VECTOR_OPS, ProgramGraph, Role, ValueKey
from autopar.mesh import ProcessMesh
from autopar.rewrites.stage_constants import constant_ops


def stage_meshes(mesh: ProcessMesh) -> list[ProcessMesh]:
    """The pipeline's stage meshes, ``mesh[0]``, ``mesh[1]``, ... (one-dim meshes: none)."""
    return [mesh[i] for i in range(mesh.shape[0])] if mesh.ndim >= 1 and mesh.shape[0] > 1 else []


def on_stages(mesh: ProcessMesh, user: Mapping[ValueKey, DistAttr]) -> bool:
    """Whether an annotation places a value on one stage's sub-mesh of a mesh whose first dim
    is ``pp`` (Paddle's way of placing stages without shard_op)."""
    stages = stage_meshes(mesh) if mesh.dim_names[0] == "pp" else []
    return any(attr.mesh in stages for attr in user.values())


def infer_stages(
    graph: ProgramGraph, mesh: ProcessMesh, user: Mapping[ValueKey, DistAttr], placed: Mapping[int, ProcessMesh]
) -> dict[int, ProcessMesh]:  # fmt: skip
    """``placed`` plus the stage mesh of every unplaced forward op whose inputs live on a stage
    (module docstring)."""
    stages = stage_meshes(mesh)
    order = {stage: i for i, stage in enumerate(stages)}
    where: dict[ValueKey, ProcessMesh] = {key: attr.mesh for key, attr in user.items() if attr.mesh in order}
    out = dict(placed)
    for op in graph.ops:
        if op.role is not Role.FORWARD:
            continue
        mesh_of_op = out.get(op.index)
        if mesh_of_op is None:
            found = {where[key] for key in op.inputs if key is not None and key in where}
            if op.name in VECTOR_OPS or not found:
                mesh_of_op = max(found, key=order.__getitem__) if found else None
            else:
                mesh_of_op = out[op.index] = max(found, key=order.__getitem__)
        if mesh_of_op is not None and mesh_of_op in order:
            for key in op.outputs:
                if key is not None:
                    where.setdefault(key, mesh_of_op)
    return out


def reader_stages(graph: ProgramGraph, placed: Mapping[int, ProcessMesh]) -> dict[int, ProcessMesh]:
    """``placed`` plus, for each unplaced forward op that is not built from constants alone (those
    are copied to every stage reading them), the stage mesh of its readers — the earliest in
    program order when several — found from the last op back, so a chain of such ops
    (parameter -> expand -> concat) takes the stage of the placed op at its end."""
    out = dict(placed)
    first_seen: dict[ProcessMesh, int] = {}
    for op in graph.ops:
        if op.role is Role.FORWARD and op.index in out:
            first_seen.setdefault(out[op.index], op.index)
    constants = constant_ops(graph)
    for op in reversed(graph.ops):
        if op.role is not Role.FORWARD or op.index in out or op.index in constants or op.name in VECTOR_OPS:
            continue
        readers = {
            out[user] for key in op.outputs if key is not None for user in graph.values[key].users
            if user in out and graph.ops[user].role is Role.FORWARD and out[user] in first_seen
        }  # fmt: skip
        if readers:
            out[op.index] = min(readers, key=first_seen.__getitem__)
    return out
