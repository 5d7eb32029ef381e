"""``autopar.check``: clean (no false positive) on every strategy configuration and every
example, and, with a bug injected into the rank plans (autopar.testing.faults), the first
difference it reports is the op where the first wrong value appears, with its layer and the
collective that fed it."""

import subprocess
import sys
import textwrap

import pytest

import autopar
from autopar.errors import AutoparError
from autopar.inspect.check import reduction_length
from autopar.schedule import UPDATE
from autopar.testing import faults
from autopar.testing.catalog import CONFIGS, build, feeds

# A check is quiet: a mask's -inf on both sides is no difference, not inf - inf = NaN with a
# RuntimeWarning (and a tolerance of inf that let it pass).
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

EXAMPLES = {
    "simple_net dp": ("examples.simple_net", ("dp",)),
    "simple_net mp": ("examples.simple_net", ("mp",)),
    "simple_net dp_mp": ("examples.simple_net", ("dp_mp",)),
    "gpt_block mp": ("examples.gpt_block", ("mp",)),
    "gpt_block dp_mp": ("examples.gpt_block", ("dp_mp",)),
    "alexnet 2": ("examples.alexnet", (2,)),
    "alexnet 4": ("examples.alexnet", (4,)),
    "linear_net": ("examples.linear_net", ()),
    "pipeline_net": ("examples.pipeline_net", ()),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_clean_on_every_strategy(name):
    seed, dist = build(name)
    report = autopar.check(dist, feeds(seed, 2))
    assert report.clean, str(report)
    assert report.compared > 20 and "every value equals serial" in str(report)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_clean_on_every_example(name):
    import importlib

    module, args = EXAMPLES[name]
    seed, dist = importlib.import_module(module).build(*args)
    report = autopar.check(dist, feeds(seed, 2))
    assert report.clean, str(report)


def first_difference(name, edit, steps=1):
    seed, dist = build(name)
    report = autopar.check(faults.FaultyProgram(dist, edit), feeds(seed, steps))
    assert not report.clean
    return report.first, str(report)


def test_a_removed_gradient_all_reduce_is_named_at_the_first_update():
    first, text = first_difference("simple dp2", faults.collective_removed(lambda c: c.kind.value == "all_reduce"))
    assert first.op.startswith("pd_op.momentum_") and first.layer.startswith("Linear"), text
    assert first.replicas and any(line.startswith("all_reduce") and "gradient sync over dp" in line for line in first.collectives), text


def test_a_wrong_reduce_op_is_named_at_the_op_reading_the_row_parallel_sum():
    first, text = first_difference(
        "simple mp2", faults.wrong_reduce(lambda c: c.kind.value == "all_reduce" and "row-parallel" in c.reason)
    )
    assert first.op.startswith("pd_op.add#") and first.layer.startswith("Linear"), text  # the bias add after it
    assert first.error > 0.1 and any("row-parallel output" in line for line in first.collectives), text


def test_a_slice_of_the_wrong_piece_is_named_at_the_sharded_update():
    first, text = first_difference("gpt dp2 zero2", faults.wrong_piece(lambda c: c.kind.value == "reduce_scatter"))
    assert first.op.startswith("pd_op.momentum_") and first.placement == "[S(0)]", text
    assert any(line.startswith("reduce_scatter") and "ZeRO gradient sync" in line for line in first.collectives), text


def test_a_replica_updated_on_one_rank_only():
    first, text = first_difference("simple dp2", faults.not_updated_on(1))
    assert first.op.startswith("pd_op.momentum_") and "rank 1's copy differs from rank 0's" in first.replicas, text


def _backward_phase(plan, position):
    """The phase of the op making what the collective at ``position`` sends."""
    ops = list(plan.program.global_block().ops)
    made = ops[position].operand_source(0).get_defining_op().id()
    return plan.pipeline.phases[[op.id() for op in ops].index(made)]


def test_the_tied_embedding_bug_is_refused_by_the_link_it_breaks():
    """The shared-parameter bug re-introduced: the head's part of the tied weight's gradient sent
    once per micro-batch (in its backward) while the owner receives once per step. Links deliver
    in order (the host backend's as NCCL's): the owner's next message on the link is not the one
    it waits for, and the run stops naming both keys and the link (when recvs searched by key,
    micro-batches 1..3's parts were dropped silently and ``check`` found the wrong sum)."""
    def is_part(c):
        return c.kind.value == "send" and "part of grad(" in c.reason

    _, dist = build("tied lm pp2 ZBH1")
    part = next(c for c, _ in dist.rank_plan(1).collectives if is_part(c))
    with pytest.raises(
        AutoparError,
        match=rf"rank 0: RECV\[.* 1->0\] waits for the message of key .*, but the next message on link rank 1 -> rank 0 has key {part.key}",
    ):
        first_difference("tied lm pp2 ZBH1", faults.run_in_phase(is_part, _backward_phase))


def test_a_weight_gradient_made_once_per_step():
    """The embedding's weight gradient op moved from its backward to the once-per-step update
    phase: it reads micro-batch 0's token ids beside the gradients of every micro-batch."""
    import dataclasses

    def once_per_step(plan):
        ops = list(plan.program.global_block().ops)
        phases = [UPDATE if op.name() == "pd_op.embedding_grad" else phase for op, phase in zip(ops, plan.pipeline.phases)]
        return dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, phases=tuple(phases)))

    first, text = first_difference("tied lm pp2 ZBH1", once_per_step)
    assert first.op.startswith("pd_op.embedding_grad#") and first.layer.startswith("Embedding"), text


def test_reduction_lengths():
    seed, dist = build("gpt mp2")
    graph = dist.graph
    first = {}
    for op in graph.ops:
        if op.outputs and op.outputs[0] is not None:
            first.setdefault(op.short_name, reduction_length(graph, op.outputs[0]))
    assert first["matmul"] == 32  # the qkv projection: hidden 32 summed per element
    assert first["matmul_grad"] >= 4 * 8  # its weight gradient sums over batch x sequence rows
    assert first["gelu"] == 1 and first["softmax"] == 8 and first["add_n"] >= 2


def test_bad_arguments_are_refused_by_name():
    seed, dist = build("simple dp2")
    with pytest.raises(AutoparError, match="check needs feeds"):
        autopar.check(dist, "x")
    with pytest.raises(AutoparError, match="steps=3 but only 1 feed dicts"):
        autopar.check(dist, feeds(seed, 1), steps=3)
    report = autopar.check(dist, feeds(seed, 1)[0], steps=2)  # one dict: used for every step
    assert report.clean and report.steps == 2


def test_command_line_exit_codes(tmp_path):
    target = tmp_path / "target.py"
    target.write_text(textwrap.dedent(
        """
        from autopar.testing import faults
        from autopar.testing.catalog import build

        def clean():
            return build("simple dp2")[1]

        def broken():
            return faults.FaultyProgram(build("simple mp2")[1], faults.wrong_reduce(lambda c: c.kind.value == "all_reduce"))
        """
    ))  # fmt: skip
    run = [sys.executable, "-m", "autopar.cli", "check"]
    ok = subprocess.run([*run, f"{target}:clean"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "every value equals serial" in ok.stdout, ok.stdout + ok.stderr
    bad = subprocess.run([*run, f"{target}:broken", "--steps", "2"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "first difference (step 0): pd_op.add#" in bad.stdout, bad.stdout + bad.stderr


def test_a_recomputed_dropout_is_compared_by_what_its_clone_remakes():
    """GPT-2 with dropout under recompute: each dropout is recomputed as ``x * cast(mask) / (1 - p)``
    from its kept mask. The clone's last op re-makes the dropout's output and is compared with it;
    the cast mask and the product are compared as themselves (paired by output slot, the cast of
    the mask was compared with the dropout's output: 5 false differences)."""
    from autopar.inspect.check import remade
    from autopar.testing.zoo import gpt2

    config, mesh = gpt2.Config(dropout=0.1), autopar.ProcessMesh([0, 1], ["dp"])
    seed = gpt2.build(config, batch=4, seq=8, mesh=mesh)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(recompute=True))
    graph = dist.decisions.serial()
    dropouts = {op.index for op in graph.ops if op.short_name == "dropout"}
    remakes = {clone: forward for clone, forward in remade(graph).items() if forward[0] in dropouts}
    assert remakes and all(graph.ops[c[0]].short_name == "divide" and f[1] == 0 for c, f in remakes.items()), remakes
    casts = [op for op in graph.ops if op.recomputes in dropouts and op.short_name == "cast"]
    assert casts and not any(op.outputs[0] in remakes for op in casts)
    report = autopar.check(dist, gpt2.feeds(config, 4, 8, 2))
    assert report.clean, str(report)


def test_a_pipelines_whole_batch_copy_of_a_feed_is_given_its_feed():
    """GPT-2's loss divides by the whole batch's count of valid targets: under a pipeline that
    count is made from ``targets@whole_batch``, a feed the serial run needs too (it failed with
    KeyError 'targets@whole_batch'). The copy is given its feed's array; random feeds draw only
    the user's feeds."""
    from autopar.inspect.check import random_feeds
    from autopar.testing.zoo import gpt2

    config, mesh = gpt2.Config(), autopar.ProcessMesh([0, 1], ["pp"])
    seed = gpt2.build(config, batch=4, seq=8, mesh=mesh)
    pipeline = autopar.PipelineConfig(micro_batches=2, stages=2)
    dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=autopar.Strategy(pipeline=pipeline))
    assert "targets@whole_batch" in dist.values.named("feed")
    assert set(random_feeds(dist)[0]) == {"idx", "targets"}
    report = autopar.check(dist, gpt2.feeds(config, 4, 8, 2))
    assert report.clean and report.micro_batches == 2, str(report)
