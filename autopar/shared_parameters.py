"""Parameters read on several pipeline stages (stage: annotation -> reshard planning).

A tied word embedding is looked up on the first stage and read again by the LM head's matmul
on the last; a layer called on two stages reads its weights on both. Such a parameter ``W``
has one update for the whole step, from the gradient summed over every stage that reads it
and every micro-batch, and every stage reading it must see the updated value next step.

autopar gives ``W`` one *owner*: the stage of its first forward reader. There:

- the sum of ``W``'s gradient contributions and its update (with the optimizer states, which
  live on the owner only) run on the owner's mesh (:func:`owner_meshes`, before propagation);
  another stage's contribution is accumulated over its micro-batches on that stage and sent
  to the owner once per step, in the optimizer phase (a send read by an update runs with the
  update, :mod:`autopar.passes.pipeline_split`), never once per micro-batch;
- right after the update, the updated ``W`` is sent to every other stage that keeps a copy
  of it (:func:`replica_refreshes`, a write-back into that copy), so every copy holds the
  same value bit for bit, and the next step's forward reads it.

Why an owner rather than an all_reduce of the gradient over the holders with one update on
each (Megatron's tied embeddings): for two holders both move ``|W|`` per rank (the gradient
one way, the updated value back) while the optimizer states (Adam: ``2·|W|``) are kept on
one stage only, and the update reuses every placement the owner's mesh already has (data
parallel, ZeRO, tensor parallel inside the stage) without a second copy of the optimizer.
A ``W`` that is sharded on its stage is not copied: every other stage reading it receives it
at each read (a planned send / recv), which is up to date by construction.
"""

from __future__ import annotations

from collections.abc import Mapping

from autopar.causes import gradients, updates
from autopar.dist_attr import DistAttr
from autopar.graph import ProgramGraph, Role, ValueKey
from autopar.mesh import ProcessMesh
from autopar.propagation import PropagationResult, ReshardNeed, ReshardSite, SiteKind


def reader_meshes(graph: ProgramGraph, param: ValueKey, op_meshes: Mapping[int, ProcessMesh]) -> list[ProcessMesh]:
    """The meshes of the forward ops reading ``param``, in program order, each once."""
    found: dict[ProcessMesh, None] = {}
    for user in graph.values[param].users:
        op = graph.ops[user]
        if op.role is Role.FORWARD and user in op_meshes:
            found.setdefault(op_meshes[user], None)
    return list(found)


def owner_meshes(graph: ProgramGraph, op_meshes: Mapping[int, ProcessMesh]) -> dict[int, ProcessMesh]:
    """``op_meshes`` plus, for each parameter read on several stage meshes, its update and the
    optimizer ops making its gradient (the sum of its parts, clipping's rescale) on the mesh of
    its first forward reader (without this the sum ran where its first operand was made, and
    the update elsewhere: the gradient crossed the pipeline twice)."""
    placed = dict(op_meshes)
    made = gradients(graph)
    for update, _ in updates(graph):
        param = update.inputs[0]
        meshes = reader_meshes(graph, param, op_meshes)
        if len(meshes) < 2:
            continue
        placed.setdefault(update.index, meshes[0])
        for key, gradient in made.items():
            if gradient.param == param and graph.ops[key[0]].role is Role.OPTIMIZER:
                placed.setdefault(key[0], meshes[0])
    return placed


def replica_refreshes(graph: ProgramGraph, propagation: PropagationResult) -> list[ReshardNeed]:
    """For each updated parameter that another stage keeps a copy of (it is whole there: read
    without a transfer), the move of its updated value into that copy once the step's updates
    are done (a ``REFRESH`` site: after every in-place write, ZeRO's gather-back included)."""
    needs = []
    for update, _ in updates(graph):
        param = update.inputs[0]
        have = propagation.dist(param)
        if have.partial or have.sharded_mesh_dims():
            continue  # a sharded parameter is sent at each read on another stage (no copy kept there)
        owner = propagation.op_meshes.get(update.index, have.mesh)
        for mesh in reader_meshes(graph, param, propagation.op_meshes):
            if mesh != owner:
                need = DistAttr.replicated(mesh, len(graph.values[param].shape))
                site = ReshardSite(SiteKind.REFRESH, update.index, 0)
                needs.append(ReshardNeed(site, param, DistAttr.replicated(owner, len(need.mapping)), need))
    return needs
