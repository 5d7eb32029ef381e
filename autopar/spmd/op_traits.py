"""What the compiler knows of ops that have no SPMD rule (stage: propagate, read by later stages).

The facts other stages ask of an op by name (:data:`autopar.spmd.registry.TRAIT_MEANINGS`) are
declared beside the op's rule; the ops here have none (collectives, random draws, builtin
plumbing, kernels the suggester recognizes but propagation runs whole). Stages ask
``ops_where(trait)``, never a table of their own.
"""

from autopar.spmd.registry import declare

declare("all_gather", "all_reduce", collective=True, side_effect=True)
declare("all_to_all", "reduce_scatter", collective=True)
declare("amax", "amin", "fused_rms_norm", "group_norm", "instance_norm", "logsumexp", "norm", "prod", normalizing=True)
declare("barrier", "broadcast", "p_recv", "p_send", "recv_v2", "send_v2", side_effect=True)
declare(
    "bernoulli", "class_center_sample", "dirichlet", "exponential_", "fused_dropout_add", "gaussian", "multinomial",
    "poisson", "randint", "randperm", "rrelu", "truncated_gaussian_random", "uniform",
    random=True,
)
declare("bmm", keeps_split=True, matmul_like=True, contracts=True)
declare("builtin.combine", free=True, keeps_split=True, norm_plumbing=True, packs_vector=True)
declare("lamb_", "adagrad_", "rmsprop_", updates_parameter=True)  # (no rule yet: refused at propagation, with a role)
declare("fill_constant", "ones_like", loss_seed=True)
declare("builtin.parameter", "builtin.shadow_output", free=True)
declare("builtin.split", free=True, keeps_split=True, packs_vector=True)
declare("data", free=True, neutral_source=True)
declare(
    "elu", "hardswish", "leaky_relu", "mish", "relu6", "scaled_dot_product_attention", "softplus", "swish",
    keeps_split=True,
)
declare("fused_gemm_epilogue", "linear", matmul_like=True, contracts=True)
declare("shape", "shape64", neutral_source=True, shape_read=True)
declare("logsumexp", "prod", "amax", "amin", zigzag_passes="reduces")  # (the zig-zag order through an op without an equation: autopar.zigzag_values)
