"""The query API's answers and a step's timeline print as tables a person reads — layer paths
and value names, not value ids or dataclass reprs — and stay values a program reads (issue 36
item 16)."""

import re

import autopar
from autopar.passes.zero_sharding import ZeroShard
from autopar.schedule import Action
from autopar.schedule_timeline import Span, measured_timeline, simulate_timeline
from autopar.testing.catalog import build
from autopar.testing.pipeline_models import nested_decoder
from autopar.text_table import text_table

PP = autopar.ProcessMesh([0, 1], ["pp"])


def _nested_pipeline(layers: int, stages: int, schedule: str = "1F1B"):
    seed = nested_decoder(layers=layers)
    config = autopar.PipelineConfig(micro_batches=stages, stages=stages, schedule=schedule)
    return autopar.compile(seed.main, PP, startup_program=seed.startup, strategy=autopar.Strategy(pipeline=config))


def test_pipeline_prints_which_layers_each_stage_runs():
    pipeline = _nested_pipeline(layers=6, stages=2).decisions.pipeline()
    text = str(pipeline)
    assert "PipelineDecision(" not in text and "mesh(" not in text
    assert re.fullmatch(
        r"pipeline: 2 stages on 2 sub-meshes, 1F1B, 2 micro-batches \(layers of Model(_\d+)?\)", text.splitlines()[0]
    )
    stage_rows = text.splitlines()[1:4]
    assert stage_rows[0].split() == ["stage", "ranks", "layers"]
    assert stage_rows[1].split(None, 2) == ["0", "0", "Embedding, Decoder/DecoderLayer … Decoder/DecoderLayer_2"]
    assert stage_rows[2].split(None, 2) == ["1", "1", "Decoder/DecoderLayer_3 … Decoder/DecoderLayer_5, LayerNorm, Linear, outside any layer"]  # fmt: skip
    assert "1RECV_F0 1F0 1B0 1SEND_B0" in text  # each pipeline rank's actions
    # still a value: the layers each stage runs as layer paths, the rest as before
    model = pipeline.layers[0][0].split("/")[0]  # Model, or Model_n after other builds in this process
    assert pipeline.layers[0] == (f"{model}/Embedding", *(f"{model}/Decoder/DecoderLayer{s}" for s in ("", "_1", "_2")))
    assert pipeline.layers[1][:3] == tuple(f"{model}/Decoder/DecoderLayer_{k}" for k in (3, 4, 5))
    assert pipeline.meshes == (PP[0], PP[1]) and pipeline.stages == (0, 1) and str(pipeline.actions[0][0]) == "0F0"


def test_interleaved_stages_and_shared_parameters_print_by_name():
    pipeline = _nested_pipeline(layers=8, stages=4, schedule="Interleaved1F1B").decisions.pipeline()
    rows = str(pipeline).splitlines()
    assert rows[2].split(None, 2) == ["0", "0", "Embedding, Decoder/DecoderLayer, Decoder/DecoderLayer_1"]
    assert rows[4].split(None, 2) == [
        "2",
        "0",
        "Decoder/DecoderLayer_4, Decoder/DecoderLayer_5",
    ]  # stage 2 back on rank 0
    assert len(pipeline.layers) == 4

    _, tied = build("tied lm pp2 ZBH1")
    text = str(tied.decisions.pipeline())
    (shared,) = tied.decisions.pipeline().shared
    row = next(line for line in text.splitlines() if line.strip().startswith(shared.name))
    assert row.split() == [shared.name, "0", "0;", "1", "1"]  # updated on rank 0, read on both, copied to rank 1


def test_zero_prints_each_parameter_with_its_layer_and_stays_a_tuple():
    _, dist = build("gpt dp2 zero2")
    zero = dist.decisions.zero()
    assert isinstance(zero, tuple) and zero and all(isinstance(z, ZeroShard) for z in zero) and zero.stage == 2
    text = str(zero)
    assert "ZeroShard(" not in text and "DistAttr(" not in text and "(70, 0)" not in text
    lines = text.splitlines()
    sharded = sum(z.sharded is not None for z in zero)
    assert lines[0] == f"ZeRO stage 2: {sharded} of {len(zero)} parameter updates sharded"
    assert lines[1].split() == ["parameter", "layer", "ranks", "whole", "sharded", "why"]
    first = zero[0]
    row = lines[2].split()
    assert row[0] == first.label and row[1] == zero.layers[0]
    assert row[3] == str(first.whole) and row[4] == (str(first.sharded) if first.sharded else "-")
    assert any(layer.startswith("Linear") or "/Linear" in layer for layer in zero.layers)
    _, plain = build("simple dp2")
    assert plain.decisions.zero() == () and str(plain.decisions.zero()) == "ZeRO: off"


def test_sequence_prints_each_value_with_its_layer_and_split():
    _, dist = build("gpt mp2 sequence parallel")
    regions = dist.decisions.sequence()
    assert regions.axis == "mp" and regions.values and len(regions.layers) == len(regions.values)
    text = str(regions)
    assert "SequenceSplit(" not in text and "SequenceDecision(" not in text
    split = [v for v in regions.values if v.seq_dim is not None]
    assert text.splitlines()[0].startswith(
        f"sequence parallel over 'mp': {len(split)} activations split along the sequence"
    )
    layer_norm = next(i for i, layer in enumerate(regions.layers) if "LayerNorm" in layer)
    row = next(line for line in text.splitlines()[2:] if line.split()[0] == regions.values[layer_norm].label)
    assert row.split()[1] == regions.layers[layer_norm]


def test_reshards_print_each_value_by_name_with_its_cause():
    _, dist = build("simple dp2xmp2")
    reshards = dist.decisions.reshards()
    assert isinstance(reshards, tuple) and [r for r in reshards if r.kinds == ("all_reduce",)]
    lines = str(reshards).splitlines()
    assert lines[0].startswith(f"{len(reshards)} reshards (") and "ReshardDecision(" not in str(reshards)
    assert lines[1].split() == ["value", "for", "site", "from", "->", "to", "steps", "bytes", "time", "why"]
    row_parallel = next(line for line in lines if "row-parallel output in Linear" in line)
    assert row_parallel.split()[3:7] == ["read", "[S(0),P(sum)]", "->", "[S(0),R]"] and "all_reduce" in row_parallel
    grads = [line for line in lines if line.strip().startswith("grad(")]
    assert grads and all(line.rstrip().split("gradient sync over dp in ")[1].startswith("Linear") for line in grads)


def _schedule():
    parse = Action.parse
    return {0: [parse(a) for a in "0F0 0SEND_F0 0RECV_B0 0B0 0OPT".split()],
            1: [parse(a) for a in "1RECV_F0 1F0 1B0 1SEND_B0 1OPT".split()]}  # fmt: skip


def test_a_modelled_timeline_prints_per_rank_busy_idle_and_each_action():
    timeline = simulate_timeline(_schedule(), activation_bytes={0: 2048, 1: 1024})
    lines = str(timeline).splitlines()
    assert lines[0] == "pipeline step (modelled: F = 1, B = 2 unless given): 2 ranks, makespan 6, bubble 50.0%"
    assert lines[1].split() == ["rank", "busy", "idle", "peak", "stash", "peak", "activations", "actions@start-end"]
    assert lines[2].split(None, 6) == [
        "0",
        "3",
        "3",
        "1",
        "2",
        "KiB",
        "0F0@0-1, 0SEND_F0@1-1, 0RECV_B0@4-4, 0B0@4-6, 0OPT@6-6",
    ]
    assert timeline.spans[1][1].action == Action.parse("1F0") and timeline.busy(1) == 3 and not timeline.measured


def test_a_measured_timeline_prints_in_one_clock_unit():
    made = _schedule()
    spans = {0: [Span(made[0][0], 10.0, 10.002), Span(made[0][3], 10.005, 10.009)],
             1: [Span(made[1][1], 10.002, 10.003), Span(made[1][2], 10.003, 10.005)]}  # fmt: skip
    timeline = measured_timeline(spans)  # what Executor.timeline() returns
    lines = str(timeline).splitlines()
    assert lines[0] == "pipeline step (measured): 2 ranks, makespan 9ms, bubble 50.0%"  # (6 + 3) busy of 2 x 9
    assert lines[1].split()[-2:] == ["actions@start-end", "(ms)"]
    assert lines[2].split(None, 4) == ["0", "6ms", "3ms", "1", "0F0@0-2, 0B0@5-9"]
    assert lines[3].split(None, 4) == ["1", "3ms", "6ms", "1", "1F0@2-3, 1B0@3-5"]
    assert timeline.measured and abs(timeline.spans[0][1].end - 0.009) < 1e-9 and abs(timeline.busy(0) - 0.006) < 1e-9


def test_text_table_pads_columns_and_wraps_the_last():
    lines = text_table([("a", "bb", "text"), ("ccc", "d", "one two three four five six")], indent="  ")
    assert lines == ["  a    bb  text", "  ccc  d   one two three four five six"]
    assert text_table([("n", "size"), ("x", "5")], right=(0,)) == ["n  size", "x  5"] and text_table([]) == []
    wrapped = text_table(
        [("k", "v"), ("x", " ".join(["word"] * 30))], width=50
    )  # the last column 47 wide (40 at least)
    assert (
        len(wrapped) > 2
        and wrapped[1].startswith("x  word")
        and all(line.startswith("   word") for line in wrapped[2:])
    )
    assert (
        all(len(line) <= 50 for line in wrapped)
        and max(map(len, text_table([("k", "v"), ("x", "w " * 60)], width=10))) <= 43
    )
