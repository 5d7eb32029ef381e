"""autopar.suggest.annotations: the data / tensor-parallel annotations found from an unannotated
program (issue 25). The finder must be right before it splits much: on the zoo, the placements
it finds compile to a program equal to serial (losses every step, parameters after 3 SGD
steps), lose no split (no ParallelismWarning, no parameter gathered) and move fewer
collectives than gathering every split weight would.

What each zoo model gets (mp = 2):
- llama: wq / wk / wv and w1 / w3 column, wo and w2 row, the token embedding by vocabulary;
  the untied output head by columns (vocabulary-parallel logits into the cross-entropy).
- gpt2: c_fc column, the MLP's c_proj row, wte by vocabulary (the tied head then vocabulary-
  parallel); the attention whole: c_attn's output is cut three ways by columns (q | k | v), which
  a column split does not line up with (a note says so).
- bert: query / key / value and intermediate column, attention_output and output row, the word
  embeddings by vocabulary with the tied decoder's bias; the pooler and next-sentence head whole
  (the head feeds the loss), the 2-row token-type table whole.
- vit: fc1 column, fc2 row; the attention whole (qkv laid out [3, heads, head_dim]).
- mixer: both MLPs of every block (token- and channel-mixing): fc1 column, fc2 row.
"""

import warnings

import pytest

import autopar
from autopar.errors import ParallelismWarning
from autopar.graph import ProgramGraph
from autopar.suggest.annotations import TensorParallel, batch_feeds, placements, shard, tensor_parallel
from autopar.testing.models import annotate_megatron, gpt_block_program, linear_net
from autopar.testing.serial import assert_simulation_equals_serial
from autopar.testing.zoo import bert, gpt2, llama, mixer, vit

M = autopar.ProcessMesh
MP = M([0, 1], ["mp"])
DP_MP = M([[0, 1], [2, 3]], ["dp", "mp"])


def _labels(graph, keys):
    return sorted(graph.values[key].label for key in keys)


def test_gpt_block_gets_the_megatron_split():
    """The finder's placements are annotate_megatron's (qkv, fc1 column with their biases;
    proj, fc2 row), plus the token embedding split by vocabulary and the untied output head by
    columns (Megatron's vocabulary-parallel output layer)."""
    seed = gpt_block_program(layers=2)
    graph = ProgramGraph(seed.main)
    found = placements(graph, MP, tensor_parallel(graph, 2), None, "mp")
    annotate_megatron(seed, MP)
    autopar.shard_tensor(seed.layers["head"].weight, MP, [None, "mp"])
    autopar.shard_tensor(seed.layers["head"].bias, MP, ["mp"])
    dist = autopar.compile(seed.main, MP, startup_program=seed.startup)
    megatron = {key: dist.dist_attr(graph.values[key].label) for key in found}
    table = graph.by_name[seed.layers["embedding"].weight.name]
    assert found.pop(table) == autopar.DistAttr(MP, [0, -1])
    megatron.pop(table)
    assert found == megatron
    row_biases = {seed.layers[name].bias.name for name in ("proj0", "proj1", "fc2_0", "fc2_1")}
    split = {
        p.name
        for name, layer in seed.layers.items()
        if name.startswith(("qkv", "proj", "fc1_", "fc2_", "head"))
        for p in layer.parameters()
    }
    assert _labels(graph, found) == sorted(split - row_biases)


MODELS = {  # module, feeds, label classes
    "llama": (llama, None, 64),
    "gpt2": (gpt2, gpt2.feeds, 64),
    "bert": (bert, bert.feeds, 64),
    "vit": (vit, None, 5),
    "mixer": (mixer, None, 5),
}
MP4 = M([0, 1, 2, 3], ["mp"])
# (model, mesh) -> how many weights are split by columns / rows / vocabulary, column biases,
# and words the notes must hold (what was left whole and why)
CASES = {
    ("llama", MP): ((11, 4, 1, 0), []),
    ("gpt2", MP): ((2, 2, 1, 2), ["CausalSelfAttention/Linear ", "split_with_num", "q | k | v"]),
    ("bert", MP): ((8, 4, 1, 9), ["feeds the loss", "2 rows"]),
    ("vit", MP): ((2, 2, 0, 2), ["Attention/Linear ", "reshape", "[3, heads, head_dim]"]),
    ("mixer", MP): ((4, 4, 0, 4), []),
    ("llama", DP_MP): ((11, 4, 1, 0), []),
    ("gpt2", DP_MP): ((2, 2, 1, 2), ["split_with_num"]),
    # 2 kv heads cannot be split 4 ways: the attention stays whole, the feed-forward is split
    ("llama", MP4): ((5, 2, 1, 0), ["Attention/Linear_3", "heads not divisible by 4"]),
}


@pytest.mark.parametrize("case", list(CASES), ids=lambda case: f"{case[0]}-{'x'.join(map(str, case[1].shape))}")
def test_zoo_model_split_as_found_equals_serial(case):
    """Each zoo model built unannotated, split as found, compiled: equal to serial, no split
    lost, and fewer mp collectives than gathering every split weight (and scattering its
    gradient) would need."""
    model, mesh = case
    (module, feeds_of, classes), (counts, words) = MODELS[model], CASES[case]
    config = module.Config()
    seed = module.build(config, batch=4)
    graph = ProgramGraph(seed.main)
    tp = tensor_parallel(graph, mesh.dim_size("mp"))
    assert (len(tp.column), len(tp.row), len(tp.vocab), len(tp.column_bias)) == counts
    for word in words:
        assert any(word in note for note in tp.notes), (word, tp.notes)
    shard(graph, placements(graph, mesh, tp, "dp" if "dp" in mesh.dim_names else None, "mp"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ParallelismWarning)
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
    collectives = dist.comm_ops(0)
    split = {graph.values[key].label for key in (*tp.column, *tp.row, *tp.vocab, *tp.column_bias)}
    # no split weight gathered (the vocabulary-parallel cross-entropy's one all_gather is of its
    # rows' statistics: max, sum of exponentials, target logit)
    assert not [c for c in collectives if c.kind.value == "all_gather" and c.key.source != "vocab"]
    assert len([c for c in collectives if set(c.group) == set(mesh.group_of(0, "mp"))]) < 2 * len(split)
    feeds = feeds_of(config, 4, 8, 3) if feeds_of is not None else None
    assert_simulation_equals_serial(seed, dist, classes=classes, feeds=feeds)


def test_nothing_to_split_gives_an_empty_split_with_a_note():
    seed = linear_net()
    tp = tensor_parallel(ProgramGraph(seed.main), 2)
    assert tp == TensorParallel(notes=tp.notes) and not tp
    assert tp.notes and "no pair of linears" in tp.notes[0]


def test_batch_feeds_leave_a_feed_without_the_batch_dim():
    import paddle

    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [8, 5, 16], "float32")
        positions = paddle.static.data("positions", [5, 16], "float32")
        label = paddle.static.data("label", [8, 1], "int64")
        logits = paddle.nn.Linear(16, 3)((x + positions).mean(axis=1))
        loss = paddle.nn.functional.cross_entropy(logits, label).mean()
        paddle.optimizer.SGD(0.1).minimize(loss)
    graph = ProgramGraph(main)
    assert _labels(graph, batch_feeds(graph)) == ["label", "x"]
    attrs = placements(graph, DP_MP, None, "dp", "mp")
    assert {graph.values[key].label: attr for key, attr in attrs.items()} == {
        "x": autopar.DistAttr(DP_MP, ["dp", None, None]),
        "label": autopar.DistAttr(DP_MP, ["dp", None]),
    }


@pytest.mark.parametrize(
    ("vocab", "mp", "split", "note"),
    [(128, 2, True, None), (128, 4, True, None), (130, 4, False, "130 classes not divisible by mp=4"), (32, 2, False, None)],
)
def test_an_untied_output_head_is_split_by_columns_where_it_pays(vocab, mp, split, note):
    """The GPT block's untied head (hidden 64 -> vocab): split by columns with its bias when the
    vocabulary divides over mp; left whole with a note when it does not, and without one when
    it is narrower than its input (a classifier: little to save)."""
    seed = gpt_block_program(layers=1, vocab=vocab)
    graph = ProgramGraph(seed.main)
    tp = tensor_parallel(graph, mp)
    head = {graph.by_name[seed.layers["head"].weight.name], graph.by_name[seed.layers["head"].bias.name]}
    assert (head <= {*tp.column, *tp.column_bias}) is split
    assert (graph.by_name[seed.layers["head"].weight.name] in tp.heads) is split
    assert not head & {*tp.column, *tp.column_bias} or split
    heads_notes = [n for n in tp.notes if "output head" in n]
    assert (note is None and not heads_notes) or any(note in n for n in heads_notes), tp.notes
