"""Paddle's own SPMD rules as an independent oracle for differential tests.

``paddle_infer("reshape", Spec(shape, dist), [1, 72])`` calls
``paddle.base.core.get_phi_spmd_rule("reshape").infer_forward`` with Paddle's
``DistTensorSpec`` arguments (lists of Specs become vector arguments) and returns the
inferred input and output placements as our :class:`DistAttr` values, vectors flattened.
``paddle_dists`` draws placements Paddle can express (one mesh dim per tensor dim).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from autopar import DistAttr, ProcessMesh
from autopar.spmd import RuleResult
from autopar.testing import dist_attrs


@dataclass(frozen=True)
class Spec:
    shape: tuple[int, ...]
    dist: DistAttr


def _to_paddle(arg: Any) -> Any:
    from paddle.distributed.auto_parallel.static.dist_attribute import DistTensorSpec

    if isinstance(arg, Spec):
        return DistTensorSpec(list(arg.shape), arg.dist.to_paddle())
    if isinstance(arg, list) and arg and isinstance(arg[0], Spec):
        return [_to_paddle(a) for a in arg]
    return arg


def _flatten(items: Any) -> list[DistAttr | None]:
    """Paddle's dist attrs in order, vectors flattened; None for an absent operand's (no mesh)."""
    out: list[DistAttr | None] = []
    for item in items:
        if isinstance(item, (list, tuple)):
            out.extend(_flatten(item))
        else:
            out.append(DistAttr.from_paddle(item) if item.process_mesh is not None else None)
    return out


def paddle_infer(name: str, *args: Any) -> tuple[list[DistAttr], list[DistAttr]]:
    """Paddle's forward (inputs, outputs) for ``name``; args positional in the PHI op's order."""
    from paddle.base import core

    result = core.get_phi_spmd_rule(name).infer_forward(*[_to_paddle(a) for a in args])
    return _flatten(result[0]), _flatten(result[1])


def paddle_infer_backward(
    name: str, tensors: list[Any], outputs: list[Spec], *attrs: Any
) -> tuple[list[DistAttr], list[DistAttr]]:
    """Paddle's backward inference: ``infer_backward(*inputs, *outputs, *attrs)``."""
    from paddle.base import core

    args = [_to_paddle(a) for a in tensors] + [_to_paddle(o) for o in outputs] + list(attrs)
    result = core.get_phi_spmd_rule(name).infer_backward(*args)
    return _flatten(result[0]), _flatten(result[1])


def paddle_dists(mesh: ProcessMesh, ndim: int, partial: bool = False) -> st.SearchStrategy[DistAttr]:
    """Placements with at most one mesh dim per tensor dim (Paddle's dims_mapping form)."""
    return dist_attrs(mesh, ndim, partial).filter(lambda d: all(len(m) <= 1 for m in d.mapping))


def differences(
    ours: RuleResult, inputs: list[DistAttr], outputs: list[DistAttr], tensor_inputs: list[int]
) -> list[str]:
    """Where our required inputs (at ``tensor_inputs``) and outputs differ from Paddle's."""
    diffs = []
    for k, i in enumerate(tensor_inputs):
        if k < len(inputs) and inputs[k] is not None and ours.inputs[i].mapping != inputs[k].mapping:
            diffs.append(f"input {i}: ours {ours.inputs[i]} paddle {inputs[k]}")
    for j, (mine, theirs) in enumerate(zip(ours.outputs, outputs)):
        if mine is None or theirs is None:
            continue
        if mine.mapping != theirs.mapping or set(mine.partial_dims) != set(theirs.partial_dims):
            diffs.append(f"output {j}: ours {mine} paddle {theirs}")
    return diffs


# ---- comparison helpers for einsum-like ops (matmul, elementwise, reductions, softmax, ...) ----


def drop_trivial(dist: DistAttr | None) -> DistAttr | None:
    """``dist`` without splits or partials over mesh dims of one rank (they change nothing)."""
    if dist is None:
        return None
    mesh = dist.mesh
    mapping = tuple(tuple(d for d in dims if mesh.shape[d] > 1) for dims in dist.mapping)
    return DistAttr.of(mesh, mapping, {d: k for d, k in dist.partial if mesh.shape[d] > 1})


def nontrivial_differences(
    ours: RuleResult,
    inputs: list[DistAttr],
    outputs: list[DistAttr],
    tensor_inputs: list[int],
    input_partials: bool = False,
) -> list[str]:
    """:func:`differences` once one-rank mesh dims are dropped on both sides; with
    ``input_partials`` the required inputs' partial mesh dims are compared too."""
    mine = RuleResult(tuple(map(drop_trivial, ours.inputs)), tuple(map(drop_trivial, ours.outputs)))
    inputs, outputs = [drop_trivial(d) for d in inputs], [drop_trivial(d) for d in outputs]
    diffs = differences(mine, inputs, outputs, tensor_inputs)
    if input_partials:
        for k, i in enumerate(tensor_inputs):
            if k < len(inputs) and inputs[k] is not None and set(mine.inputs[i].partial_dims) != set(inputs[k].partial_dims):
                diffs.append(f"input {i} partial: ours {mine.inputs[i]} paddle {inputs[k]}")
    return diffs


def split_hazards(
    letters: list[str], shapes: list[tuple[int, ...]], dists: list[DistAttr | None], one_rank_dims: bool = False
) -> list[str]:
    """Why two sound rules may answer differently for these operands (empty: a clean case).

    Per operand its dim letters (an equation's left side, ``1`` for a broadcast dim), shape and
    given placement. Hazards: a dim its number of parts does not divide (uneven, or more parts
    than elements: we never cut empty pieces); one letter split differently by two operands; one
    mesh dim splitting two letters. Rules break such ties and drop such splits differently.
    Mesh dims of one rank are ignored unless ``one_rank_dims`` (Paddle refuses competing
    splits even there).
    """
    reasons: list[str] = []
    by_letter: dict[str, tuple[int, ...]] = {}
    owner: dict[int, str] = {}
    for names, shape, dist in zip(letters, shapes, dists):
        dist = dist if one_rank_dims else drop_trivial(dist)
        if dist is None:
            continue
        for letter, size, dims in zip(names, shape, dist.mapping):
            if not dims:
                continue
            parts = 1
            for d in dims:
                parts *= dist.mesh.shape[d]
            if size % parts or size == 1:  # Paddle labels every size-1 dim alike (broadcast)
                reasons.append(f"dim '{letter}' of size {size} split into {parts}")
            if by_letter.setdefault(letter, dims) != dims:
                reasons.append(f"dim '{letter}' split over {by_letter[letter]} and {dims}")
            for d in dims:
                if owner.setdefault(d, letter) != letter:
                    reasons.append(f"mesh dim {d} splits '{owner[d]}' and '{letter}'")
    return reasons


def agree_or_explained(diffs, hazards, check):
    """A clean case must agree with Paddle exactly; a hazardous one (agreeing or not) must be
    numerically right (``check`` runs check_rule)."""
    if hazards:
        check()
    else:
        assert not diffs, diffs
