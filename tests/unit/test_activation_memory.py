"""The memory model's activations per rank against what the rank program keeps for its
backward (``program_saved_bytes``: values made before the first gradient op and read by a later
op; shape-only reads keep nothing). Equal, byte for byte, for tensor parallelism, sequence
parallelism (the gathered input of a column-parallel linear is kept for its matmul_grad instead
of the split value) and recompute; and sequence parallelism halves the norm / residual /
dropout activations on mp=2."""

import pytest

import autopar
from autopar.cost_model.memory import tensor_bytes
from autopar.inspect.cost_report import program_saved_bytes, saved_activations
from autopar.testing.models import annotate_megatron, gpt_block_program

CONFIGS = {
    "TP": {},
    "TP+SP": {"sequence_parallel": True},
    "TP+SP+recompute": {"sequence_parallel": True, "recompute": ("softmax", "dropout")},
    "TP+layers recomputed": {"recompute": True},
}


def compiled(options, mesh=None):
    mesh = mesh or autopar.ProcessMesh([0, 1], ["mp"])
    seed = gpt_block_program(batch=4, seq=16, hidden=32, heads=4, vocab=64, layers=2, optimizer="momentum", dropout=0.1)
    annotate_megatron(seed, mesh)
    if "dp" in mesh.dim_names:
        autopar.shard_tensor(seed.feeds["ids"], mesh, ["dp", None])
    return autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(**options))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_model_counts_what_the_program_keeps(config):
    dist = compiled(CONFIGS[config])
    for rank in dist.mesh.ranks:
        assert dist.cost.ranks[rank].memory.activations == program_saved_bytes(dist.rank_plan(rank, backend="native").program)


def test_sequence_parallel_halves_the_norm_residual_and_dropout_activations():
    tp, sp = compiled({}), compiled({"sequence_parallel": True})
    region = {v.key for v in sp.state.sequence.values if v.seq_dim is not None}

    def region_bytes(dist):
        g = dist.graph
        return sum(tensor_bytes(g.values[k].shape, g.values[k].dtype, dist.propagation.dist(k), 0)
                   for k in saved_activations(g) if k in region)  # fmt: skip

    assert region_bytes(sp) * 2 == region_bytes(tp) > 0
    assert program_saved_bytes(sp.rank_plan(0, backend="native").program) < program_saved_bytes(tp.rank_plan(0, backend="native").program)
