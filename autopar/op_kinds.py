"""Names of PIR ops that several stages treat alike (one definition for graph, runtime, inspection).

Source ops read the scope by name (parameters, feeds, persistable states); constant ops
carry their value in attributes.
"""

SOURCE_OPS = ("builtin.parameter", "pd_op.data")
CONSTANT_OPS = ("pd_op.full_int_array", "pd_op.full")
