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


def _flatten(items: Any) -> list[DistAttr]:
    out: list[DistAttr] = []
    for item in items:
        if isinstance(item, (list, tuple)):
            out.extend(_flatten(item))
        else:
            out.append(DistAttr.from_paddle(item))
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
        if k < len(inputs) and ours.inputs[i].mapping != inputs[k].mapping:
            diffs.append(f"input {i}: ours {ours.inputs[i]} paddle {inputs[k]}")
    for j, (mine, theirs) in enumerate(zip(ours.outputs, outputs)):
        if mine is None:
            continue
        if mine.mapping != theirs.mapping or set(mine.partial_dims) != set(theirs.partial_dims):
            diffs.append(f"output {j}: ours {mine} paddle {theirs}")
    return diffs
