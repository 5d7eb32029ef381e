"""Context parallelism (``Strategy(context_parallel=ContextParallel(dim="sep", method=...))``)
in the simulator: the zoo's Llama and GPT-2 (with attention dropout) equal serial — losses
every step and parameters after 3 SGD steps — with the sequence split over ``sep`` (cp = 2
and 4) for the "all_gather" plan (q split, K / V gathered whole) and Ulysses' "all_to_all"
(q, k, v and the core's output split on heads around each attention core), alone and with
dp, tensor parallelism + sequence parallelism, a 2-stage pipeline and recompute; the split
feeds ring attention (passes/ring_attention.py) too, and the zig-zag balance reorders it first.
On the GPU profile Ulysses is exactly its four all_to_alls a layer forward and four backward."""

import pytest

import autopar
from autopar.graph import Role
from autopar.testing.serial import assert_simulation_equals_serial
from autopar.testing.zoo import gpt2, llama

M = autopar.ProcessMesh
SEP = {2: M([0, 1], ["sep"]), 4: M([0, 1, 2, 3], ["sep"])}
DP_SEP, SEP_MP, PP_SEP = (M([[0, 1], [2, 3]], names) for names in (["dp", "sep"], ["sep", "mp"], ["pp", "sep"]))
BATCH, SEQ = 4, 8
MODELS = {  # name -> (module, config, feeds (None: random tokens), the token and label feeds)
    "llama": (llama, llama.Config(), None, ("tokens", "labels")),
    "gpt2 dropout": (gpt2, gpt2.Config(dropout=0.1), gpt2.feeds, ("idx", "targets")),
    "gpt2": (gpt2, gpt2.Config(), gpt2.feeds, ("idx", "targets")),
}


def compiled(model, mesh, method, **fields):
    module, config, feeds_of, _ = MODELS[model]
    seed = module.build(config, batch=BATCH, seq=SEQ, mesh=mesh)
    strategy = autopar.Strategy(context_parallel=autopar.ContextParallel("sep", method), **fields)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    return seed, dist, feeds_of(config, BATCH, SEQ, 3) if feeds_of is not None else None


def score_matmuls(dist):
    """The forward ``matmul(q, k, transpose_y=True)`` of each attention core."""
    return [op for op in dist.graph.ops if op.role is Role.FORWARD and op.short_name == "matmul" and op.attrs.get("transpose_y")
            and len(dist.graph.values[op.inputs[0]].shape) == 4]  # fmt: skip


def sep_of(placement, tensor_dim):
    """Whether ``placement`` splits ``tensor_dim`` over the mesh dim ``sep``."""
    return placement.mesh.dim_names.index("sep") in placement.mapping[tensor_dim]


def assert_split(model, dist, method, feeds=True):
    """The token and label feeds split on the sequence over sep (``feeds``: not their zig-zag
    copies); each core's q split on the sequence (all_gather; ring, which lowers the core over
    that split) or on heads (all_to_all)."""
    for name in MODELS[model][3] if feeds else ():
        assert sep_of(dist.decisions.placement(name), 1), name
    cores = score_matmuls(dist)
    assert len(cores) == 2
    for op in cores:
        q = dist.decisions.placement(op.inputs[0])
        assert sep_of(q, 1 if method == "all_to_all" else 2), (op, q)


@pytest.mark.parametrize("method", ["all_gather", "all_to_all"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("model", ["llama", "gpt2 dropout"])
def test_zoo_model_with_the_sequence_split_equals_serial(model, cp, method):
    seed, dist, feeds = compiled(model, SEP[cp], method)
    assert_split(model, dist, method)
    assert_simulation_equals_serial(seed, dist, classes=64, feeds=feeds)


COMPOSED = {  # name -> (mesh, method, other Strategy fields, the model)
    "dp2 x sep2, llama, all_to_all": (DP_SEP, "all_to_all", {}, "llama"),
    "sep2 x mp2 + SP, llama, all_to_all": (SEP_MP, "all_to_all", {"sequence_parallel": "mp"}, "llama"),
    "sep2 x mp2 + SP, gpt2 dropout, all_gather": (SEP_MP, "all_gather", {"sequence_parallel": "mp"}, "gpt2 dropout"),
    "pp2 x sep2 1F1B m=2, llama, all_to_all": (PP_SEP, "all_to_all", {"pipeline": autopar.PipelineConfig(micro_batches=2)}, "llama"),
    "pp2 x sep2 1F1B m=2, gpt2 dropout, all_gather": (
        PP_SEP, "all_gather", {"pipeline": autopar.PipelineConfig(micro_batches=2)}, "gpt2 dropout",
    ),  # fmt: skip
    "sep2 x mp2 + SP, llama, ring": (SEP_MP, "ring", {"sequence_parallel": "mp"}, "llama"),
    "recompute dp2 x sep2, gpt2 dropout, all_to_all": (DP_SEP, "all_to_all", {"recompute": True}, "gpt2 dropout"),
}


@pytest.mark.parametrize("name", list(COMPOSED))
def test_context_parallelism_composes_and_equals_serial(name):
    mesh, method, fields, model = COMPOSED[name]
    seed, dist, feeds = compiled(model, mesh, method, **fields)
    assert_split(model, dist, method)
    if "dp" in mesh.dim_names:  # the user's batch split kept, the sequence added
        tokens = dist.decisions.placement(MODELS[model][3][0])
        assert tokens.mapping[0] == (mesh.dim_names.index("dp"),)
    assert_simulation_equals_serial(seed, dist, classes=64, feeds=feeds)


ZIGZAG = {  # name -> (mesh, method, other Strategy fields, the model)
    "sep2, llama, all_gather": (SEP[2], "all_gather", {}, "llama"),
    "sep4, llama, all_to_all": (SEP[4], "all_to_all", {}, "llama"),
    "sep2, gpt2, ring": (SEP[2], "ring", {}, "gpt2"),
    "pp2 x sep2 1F1B m=2, llama, all_to_all": (PP_SEP, "all_to_all", {"pipeline": autopar.PipelineConfig(micro_batches=2)}, "llama"),
    "sep2 x mp2 + SP, gpt2, all_to_all, recompute": (SEP_MP, "all_to_all", {"sequence_parallel": "mp", "recompute": True}, "gpt2"),
}


@pytest.mark.parametrize("name", list(ZIGZAG))
def test_the_zigzag_split_equals_serial(name):
    """balance="zigzag": the feeds, position aranges and causal masks reordered in the program
    (rank i holds chunks i and 2cp-1-i); the step is the serial one."""
    mesh, method, fields, model = ZIGZAG[name]
    module, config, feeds_of, _ = MODELS[model]
    seed = module.build(config, batch=BATCH, seq=SEQ, mesh=mesh)
    strategy = autopar.Strategy(context_parallel=autopar.ContextParallel("sep", method, "zigzag"), **fields)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    assert dict(dist.decisions.rewrites())["zigzag_order"].startswith("zig-zag order (rank i: chunks i and 2cp-1-i) on ")
    assert_split(model, dist, method, feeds=False)
    feeds = feeds_of(config, BATCH, SEQ, 3) if feeds_of is not None else None
    assert_simulation_equals_serial(seed, dist, classes=64, feeds=feeds)


def attention_collectives(dist, kind):
    """(forward, backward) counts of the planned ``kind`` steps of the reshards."""
    counts = [0, 0]
    for reshard in dist.decisions.reshards():
        forward = dist.graph.ops[reshard.op_index].role is Role.FORWARD
        counts[0 if forward else 1] += reshard.kinds.count(kind)
    return tuple(counts)


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_ulysses_moves_q_k_v_in_and_the_output_back_with_one_all_to_all_each(model):
    """h100-node: per layer, the forward's q, k, v (sequence -> heads) and the core's output
    (heads -> sequence), and the backward's mirror: 4 + 4 all_to_alls, no gathered K / V. The
    all_gather plan on the same profile gathers K and V whole for each layer instead."""
    layers = 2
    seed, dist, feeds = compiled(model, SEP[2], "all_to_all", cluster="h100-node")
    assert attention_collectives(dist, "all_to_all") == (4 * layers, 4 * layers)
    kv_gathers = [r for r in dist.decisions.reshards() if "all_gather" in r.kinds and any(r.op_index == op.index for op in score_matmuls(dist))]
    assert kv_gathers == []
    assert_simulation_equals_serial(seed, dist, classes=64, feeds=feeds)
    _, gathered, _ = compiled(model, SEP[2], "all_gather", cluster="h100-node")
    assert attention_collectives(gathered, "all_to_all") == (0, 0)
    score_reads = {op.index for op in score_matmuls(gathered)}
    keys = [r for r in gathered.decisions.reshards() if r.op_index in score_reads and r.kinds == ("all_gather",)]
    assert len(keys) == layers  # K gathered whole for each core's scores (V for its second matmul)


@pytest.mark.parametrize("method", ["ring", "all_to_all"])
def test_a_bidirectional_model_equals_serial(method):
    """Attention without a causal mask (the zoo's BERT: a padding mask fed with the tokens, no
    triangle), the sequence split over sep2."""
    from autopar.testing.zoo import bert

    config, mesh = bert.Config(num_hidden_layers=2), autopar.ProcessMesh([0, 1], ["sep"])
    seed = bert.build(config, batch=4, seq=8)
    strategy = autopar.Strategy(context_parallel=autopar.ContextParallel("sep", method))
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=strategy)
    assert_simulation_equals_serial(seed, dist, feeds=bert.feeds(config, 4, 8, 3))
