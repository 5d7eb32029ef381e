"""autopar.testing: check your own SPMD rule numerically in one call.

    from autopar.testing import check_rule, eager
    check_rule("matmul", eager(paddle.matmul), [x, y], [x_dist, None], {}, mesh)

Strategies (``meshes``, ``dist_attrs``, ``shapes``) generate the cases for hypothesis.
"""

from autopar.pieces import assemble, reduce_partials, scatter, split_partial
from autopar.testing.checker import RuleCheck, RuleCheckError, check_rule
from autopar.testing.eager import dygraph, eager, eager_grad
from autopar.testing.strategies import dist_attrs, maybe_dist_attrs, meshes, shapes

__all__ = [
    "RuleCheck", "RuleCheckError", "assemble", "check_rule", "dist_attrs", "dygraph", "eager", "eager_grad",
    "maybe_dist_attrs", "meshes", "reduce_partials", "scatter", "shapes", "split_partial",
]  # fmt: skip
