"""Names of PIR ops that several stages treat alike (one definition for graph, runtime, inspection).

Source ops read the scope by name (parameters, feeds, persistable states); constant ops
carry their value in attributes; constant fills write a value from their attributes into their
operand in place (``paddle.to_tensor`` in a static program, a Python scalar given to
``paddle.where``: ``full`` + ``assign_value_``), whatever the operand held: a constant too.
"""

SOURCE_OPS = ("builtin.parameter", "pd_op.data")
CONSTANT_OPS = ("pd_op.full_int_array", "pd_op.full")
CONSTANT_FILLS = ("pd_op.assign_value_", "pd_op.assign_value")
