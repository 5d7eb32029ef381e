"""What context parallelism knows of the ops an attention core is made of (stage: propagate,
read by :mod:`autopar.attention_cores` and the ring lowering, issue 39).

The ops below have their rules elsewhere (elementwise, masking, fill); this module only declares
the two traits the attention-core finder asks: the ops that may stand between a core's scores
and its softmax (a scale, a mask and its broadcast), and the triangles, whose diagonal a block of
the matrix shifts by its corner.
"""

from autopar.spmd.registry import declare

declare(
    "scale", "add", "subtract", "multiply", "divide", "where", "cast", "full_like", "tril", "triu",
    attention_middle=True,
)  # fmt: skip
declare("tril", "triu", triangle=True)
