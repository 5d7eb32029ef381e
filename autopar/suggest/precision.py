"""The precision a search prices a program in (stage: strategy search).

A user's AMP program is priced as the program it is (its values' own dtypes: a bfloat16 O2
program's matmuls at the device's bfloat16 rate, its fp32 masters in memory), and the search
says which precision it read off the program (:func:`read`). A float32 program may be priced as
the mixed-precision program it stands for (``precision="bf16"``: what the Megatron comparison
does with its synthetic GPT-scale programs, which Paddle's CPU build cannot build in bfloat16
with AdamW); asking that of a program already in low precision, or float32 of a bfloat16 one,
is refused by name: the program's own dtypes say what it computes in.
"""

from __future__ import annotations

from typing import Any

from autopar.cost_model.precision import AS_BUILT, Precision, program_precision
from autopar.errors import AutoparError, CostModelError

MASTER_SUFFIX = "_fp32_master_0"  # Paddle's O2 master weights: persistable <param>_fp32_master_0


def read(graph: Any) -> str:
    """In words, the precision ``graph``'s program computes in (its matmuls' operand dtypes, its
    parameters' dtypes, its fp32 masters): ``"float32"``, ``"bfloat16 (O2: parameters bfloat16,
    4 fp32 master weights)"``."""
    matmuls = [graph.values[key].dtype for op in graph.ops if op.name == "pd_op.matmul" for key in op.inputs if key is not None]
    params = [v.dtype for v in graph.values.values() if v.kind == "parameter"]
    masters = sum(1 for v in graph.values.values() if v.kind == "state" and (v.name or "").endswith(MASTER_SUFFIX))
    return program_precision(matmuls, params, masters)


def chosen(who: str, given: Any, graph: Any) -> tuple[Precision, str]:
    """The :class:`Precision` to price ``graph``'s program in for the user's ``precision=``
    (None: as built), and what the search reports it as."""
    try:
        asked = Precision.parse(given)
    except CostModelError as error:
        raise AutoparError(f"{who}: {error}") from None
    own = read(graph)
    built = own.split(" ")[0]
    if asked.as_built:
        if given is not None and built != "float32":
            raise AutoparError(f"{who}: precision={given!r}, but the program computes in {own}: a mixed-precision "
                               "program is priced as built (pass precision=None)")  # fmt: skip
        return AS_BUILT, own
    if built == "float32":
        words = (f"{asked.compute} (a float32 program priced as mixed precision: {asked.compute} activations, "
                 "parameters, gradients and their collectives, float32 master weights and optimizer states)")  # fmt: skip
        return asked, words
    if built == asked.compute:
        return AS_BUILT, own
    raise AutoparError(f"{who}: precision={given!r}, but the program computes in {own}; pass precision=None "
                       "to price it as built")  # fmt: skip
