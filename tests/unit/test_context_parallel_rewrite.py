"""The context-parallel rewrites (autopar/rewrites/context_parallel.py, zigzag.py): which feeds
the split takes and how it composes their placement with the user's, what it reports
(``autopar explain``, ``dist.decisions.rewrites()``), the zig-zag order, and what is refused
by name — a dim the mesh lacks, a sequence the dim does not divide, heads or cores Ulysses
cannot split, what the zig-zag order cannot follow."""

import re

import pytest

import autopar
from autopar.errors import AutoparError
from autopar.testing.zoo import gpt2, llama

M = autopar.ProcessMesh
SEP2, SEP4 = M([0, 1], ["sep"]), M([0, 1, 2, 3], ["sep"])


def cp(method="all_gather", **fields):
    return autopar.Strategy(context_parallel=autopar.ContextParallel("sep", method), **fields)


def tagged_program(seq=8, annotate=None):
    """A sequence feed ``x`` [4, seq, 16] and a per-example weight ``w`` [4, 1] in the loss."""
    import paddle

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, seq, 16], "float32")
        w = paddle.static.data("w", [4, 1], "float32")
        if annotate is not None:
            annotate(x)
        h = paddle.nn.Linear(16, 16)(x)
        loss = (h.mean(-1) * w).mean()
        paddle.optimizer.SGD(0.1).minimize(loss)
    return main, startup


def test_the_feeds_carrying_the_sequence_are_split_and_named():
    main, startup = tagged_program()
    dist = autopar.compile(main, SEP2, startup_program=startup, strategy=cp())
    assert str(dist.decisions.placement("x")) == "[S(1)]"
    assert dist.decisions.value("x").decided_by == "strategy"
    assert str(dist.decisions.placement("w")) == "[R]"  # dim 1 is 1: not the sequence
    report = dict(dist.decisions.rewrites())["context_parallel"]
    assert report == "sequence (8) split over 'sep' (2 ranks, all_gather): dim 1 of x [4, 8, 16]; w kept (dim 1 is 1, not the sequence)"
    from autopar.cli import explain_text

    assert f"context parallel: {report}" in explain_text(dist)


def test_a_feed_with_two_dims_of_the_sequence_length_is_kept():
    """A [seq, seq] bias: which of its dims is the queries' is not known; propagation places it
    (its rows split, as the queries' scores it is added to)."""
    main, startup = masked_attention_program(mask_shape=[8, 8])
    dist = autopar.compile(main, SEP2, startup_program=startup, strategy=cp())
    assert str(dist.decisions.placement("mask")) == "[S(0)]"
    assert dist.decisions.value("mask").decided_by not in ("strategy", "user annotation")
    assert "mask kept (dim 0 is 8 long too: which dim is the sequence is not known)" in dict(dist.decisions.rewrites())["context_parallel"]


def test_a_feed_the_user_split_over_the_dim_is_kept_as_written():
    main, startup = tagged_program(annotate=lambda x: autopar.shard_tensor(x, SEP2, [autopar.Shard(2)]))
    dist = autopar.compile(main, SEP2, startup_program=startup, strategy=cp())
    assert str(dist.decisions.placement("x")) == "[S(2)]"
    assert "x kept (annotated over 'sep' by you: [S(2)])" in dict(dist.decisions.rewrites())["context_parallel"]


def test_the_users_batch_split_is_kept_and_the_sequence_added():
    mesh = M([[0, 1], [2, 3]], ["dp", "sep"])
    main, startup = tagged_program(annotate=lambda x: autopar.shard_tensor(x, mesh, [autopar.Shard(0), autopar.Replicate()]))
    dist = autopar.compile(main, mesh, startup_program=startup, strategy=cp())
    assert str(dist.decisions.placement("x")) == "[S(0),S(1)]"
    assert dist.decisions.value("x").decided_by == "user annotation"


def test_a_dim_the_mesh_lacks_is_refused_by_name():
    main, startup = tagged_program()
    with pytest.raises(AutoparError, match=r"ContextParallel\(dim='cp'\) names no dim of the mesh \(its dims: \['sep'\]\)"):
        autopar.compile(main, SEP2, startup_program=startup, strategy=autopar.Strategy(context_parallel=autopar.ContextParallel("cp", "all_gather")))


def test_the_zigzag_order_gives_rank_i_chunks_i_and_2cp_minus_1_minus_i():
    from autopar.rewrites.zigzag import zigzag_order

    assert zigzag_order(8, 2) == (0, 1, 6, 7, 2, 3, 4, 5)
    assert zigzag_order(8, 4) == (0, 7, 1, 6, 2, 5, 3, 4)
    assert sorted(zigzag_order(24, 3)) == list(range(24))


def test_zigzag_reorders_the_feeds_positions_and_causal_mask_and_says_so():
    seed = llama.build(llama.Config(), batch=4, seq=8, mesh=SEP2)
    dist = autopar.compile(seed.main, SEP2, startup_program=seed.startup, strategy=zigzag())
    report = dict(dist.decisions.rewrites())["zigzag_order"]
    assert re.fullmatch(r"zig-zag order \(rank i: chunks i and 2cp-1-i\) on tokens \(dims \[1\]\), labels \(dims \[1\]\), "
                        r"pd_op\.arange#\d+ \(dims \[0\]\), pd_op\.triu#\d+ \(dims \[0, 1\]\)", report)  # fmt: skip
    assert [name for name, _ in dist.decisions.rewrites()][3] == "zigzag_order"  # first: stages and micro-batches see it
    selects = [op for op in dist.graph.ops if op.short_name == "index_select"]
    assert len(selects) == 5  # tokens, labels, the rotary angles' positions, the mask's rows and columns
    reordered_tokens = next(op.outputs[0] for op in selects if dist.graph.values[op.inputs[0]].label == "tokens")
    assert str(dist.decisions.placement(reordered_tokens)) == "[S(1)]"
    assert str(dist.decisions.placement("tokens")) == "[R]"  # fed whole (integers), each rank keeps its chunks


def zigzag(method="all_gather"):
    return autopar.Strategy(context_parallel=autopar.ContextParallel("sep", method, "zigzag"))


def table_program(seq=8):
    """A sequence feed plus a position table from linspace: a table zig-zag cannot reorder."""
    import paddle

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, seq, 16], "float32")
        h = paddle.nn.Linear(16, 16)(x) + paddle.linspace(0.0, 1.0, seq).reshape([1, seq, 1])
        paddle.optimizer.SGD(0.1).minimize(h.mean())
    return main, startup


def masked_attention_program(seq=8, mask_shape=None):
    """Attention over a sequence feed with its mask fed ``[batch, 1, seq, seq]`` (Hugging Face's way)."""
    import paddle

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, seq, 16], "float32")
        mask = paddle.static.data("mask", mask_shape or [4, 1, seq, seq], "float32")
        q = paddle.nn.Linear(16, 16)(x).unsqueeze(1)
        scores = paddle.matmul(q, q, transpose_y=True) + mask
        paddle.optimizer.SGD(0.1).minimize(paddle.matmul(paddle.nn.functional.softmax(scores), q).mean())
    return main, startup


def noisy_program(seq=8):
    """A Bernoulli draw over the activations [4, seq, 16] (a random draw that is no dropout)."""
    import paddle

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, seq, 16], "float32")
        h = paddle.nn.Linear(16, 16)(x)
        paddle.optimizer.SGD(0.1).minimize((h * paddle.bernoulli(paddle.nn.functional.sigmoid(h))).mean())
    return main, startup


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("noise", r"balance='zigzag'\) over 'sep': pd_op\.bernoulli#\d+ draws random numbers"),
        ("table", r"balance='zigzag'\) over 'sep': %\d+\.0 \[1, 8, 1\], made by pd_op\.reshape#\d+ from constants and read by "
                  r"pd_op\.add#\d+, has a dim of the sequence length 8 that the zig-zag order cannot follow"),
        ("length", r"balance='zigzag'\) over 'sep' \(2 ranks\) cuts the sequence in 4 chunks: its length 6 is not divisible by 4"),
        ("mask feed", r"balance='zigzag'\) over 'sep': feed 'mask' \[4, 1, 8, 8\] has a dim of the sequence length 8 besides dim 1"),
    ],
)  # fmt: skip
def test_what_zigzag_cannot_follow_is_refused_by_name(case, match):
    if case == "noise":  # (dropout is followed: its serial mask reordered, tests/equivalence/test_zigzag.py)
        mesh, (main, startup), strategy = SEP2, noisy_program(), zigzag()
    elif case == "mask feed":
        mesh, (main, startup), strategy = SEP2, masked_attention_program(), zigzag()
    else:
        mesh, (main, startup), strategy = SEP2, table_program() if case == "table" else tagged_program(seq=6), zigzag()
    with pytest.raises(AutoparError, match=match):
        autopar.compile(main, mesh, startup_program=startup, strategy=strategy)


def test_a_sequence_the_dim_does_not_divide_is_refused_by_name():
    main, startup = tagged_program(seq=6)
    with pytest.raises(AutoparError, match=r"over 'sep' \(4 ranks\) cannot split feed 'x' \[4, 6, 16\]: its sequence length 6 \(dim 1\) is not divisible by 4"):
        autopar.compile(main, SEP4, startup_program=startup, strategy=cp())


def test_heads_ulysses_cannot_split_are_refused_by_name():
    config = gpt2.Config(n_head=2, n_embd=16)
    seed = gpt2.build(config, batch=4, seq=8, mesh=SEP4)
    with pytest.raises(AutoparError, match=r"all_to_all over 'sep' \(4 ranks\) splits the heads of attention core pd_op\.matmul#\d+: "
                       r"q '%\d+\.0' \[4, 2, 8, 8\] has 2 heads, not divisible by 4"):  # fmt: skip
        autopar.compile(seed.main, SEP4, startup_program=seed.startup, strategy=cp("all_to_all"))


def test_ulysses_without_an_attention_core_is_refused_by_name():
    main, startup = tagged_program()
    with pytest.raises(AutoparError, match=r"method='all_to_all'\) over 'sep': the program has no attention core to split on heads"):
        autopar.compile(main, SEP2, startup_program=startup, strategy=cp("all_to_all"))


def test_ulysses_on_an_attention_without_a_heads_dim_is_refused_by_name():
    import paddle

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 8, 16], "float32")
        q = paddle.nn.Linear(16, 16)(x)  # [batch, seq, hidden]: one head, no heads dim
        probabilities = paddle.nn.functional.softmax(paddle.matmul(q, q, transpose_y=True))
        paddle.optimizer.SGD(0.1).minimize(paddle.matmul(probabilities, q).mean())
    with pytest.raises(AutoparError, match=r"attention core pd_op\.matmul#\d+ reads q '%\d+\.0' \[4, 8, 16\]; Ulysses splits the heads "
                       r"of \[batch, heads, seq, head_dim\] operands only"):  # fmt: skip
        autopar.compile(main, SEP2, startup_program=startup, strategy=cp("all_to_all"))


def test_a_program_without_a_sequence_feed_is_refused_by_name():
    import paddle

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [16], "float32")
        paddle.optimizer.SGD(0.1).minimize((paddle.nn.Linear(16, 4)(x.reshape([1, 16]))).mean())
    with pytest.raises(AutoparError, match=r"over 'sep': the program has no feed of two dims or more"):
        autopar.compile(main, SEP2, startup_program=startup, strategy=cp())


def test_ulysses_reports_the_cores_it_splits_on_heads():
    seed = llama.build(llama.Config(), batch=4, seq=8, mesh=SEP2)
    dist = autopar.compile(seed.main, SEP2, startup_program=seed.startup, strategy=cp("all_to_all"))
    report = dict(dist.decisions.rewrites())["context_parallel"]
    assert report.startswith("sequence (8) split over 'sep' (2 ranks, all_to_all): dim 1 of tokens [4, 8], labels [4, 8]; ")
    assert report.endswith("q, k, v, probabilities and output of 2 attention core(s) split on heads (10 values)")


def test_an_analysis_depends_on_context_parallelism():
    main, startup = tagged_program()
    analysis = autopar.analyze(main, SEP2, startup, cp())
    with pytest.raises(AutoparError, match="the strategy's context_parallel=None but the analysis was made with context_parallel="):
        autopar.compile(main, SEP2, startup_program=startup, strategy=autopar.Strategy(), analysis=analysis)
