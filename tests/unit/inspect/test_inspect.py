"""dump_diff, the rendering and the cost report on the examples (graphviz where installed)."""

import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from autopar.inspect import cost_report, rank_view, render_dot
from autopar.inspect.render import _repeats

ROOT = Path(__file__).parents[3]
sys.path.insert(0, str(ROOT / "examples"))
import inspect_models  # noqa: E402


@cache
def dp_mp():
    return inspect_models.simple_net_dp_mp()


def test_view_marks_every_inserted_collective() -> None:
    dist = dp_mp()
    view = rank_view(dist, 0)
    comms = [op for op in view.ops if op.comm is not None]
    assert [op.comm.kind for op in comms] == [c.kind for c in dist.comm_ops(0)]
    assert all(op.status == "added" for op in comms)
    # 1 forward (row-parallel) + the 6 gradients' all_reduces fused into one
    assert [c.comm.kind for c in comms] == ["all_reduce"] * 2


def test_dot_colours_collectives_and_gives_their_reason() -> None:
    text = render_dot(rank_view(dp_mp(), 0), "rank 0")
    assert text.count('fillcolor="#f4a09c"') == len(dp_mp().comm_ops(0)) + 0  # one box per collective
    assert "ALL_REDUCE" in text and "why: row-parallel output in Linear_1:\\npd_op.add#19 reads %18.0 as" in text
    assert "[S(0),P(sum)] → [S(0),R]" in text


def test_collapse_folds_repeated_structure() -> None:
    assert _repeats([("a",), ("b",), ("a",), ("b",), ("a",), ("b",), ("c",)]) == [(0, 2, 3)]
    full = render_dot(rank_view(dp_mp(), 0), collapse=False)
    folded = render_dot(rank_view(dp_mp(), 0), collapse=True)
    assert folded.count("[label=") < full.count("[label=")
    assert "× 2" in folded


def test_layer_view_draws_one_layer() -> None:
    view = rank_view(dp_mp(), 0)
    layer = next(op.layer for op in view.ops if op.serial_index == 18)  # the row-parallel linear
    assert layer.startswith("Linear")  # Paddle numbers layers per process: Linear_1 when run alone
    text = render_dot(view, layer=layer)
    assert "ALL_REDUCE" in text and "matmul #18" in text and "matmul #15" not in text


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz 'dot' not installed")
def test_dump_writes_diffs_dots_and_svgs(tmp_path: Path) -> None:
    result = dp_mp().dump_diff(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"rank{r}.{ext}" for r in range(4) for ext in ("diff", "dot", "svg")
    )
    svg = (tmp_path / "rank0.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "ALL_REDUCE" in svg and not result.note


def test_dump_without_dot_writes_dot_files_and_says_how(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    result = dp_mp().dump_diff(tmp_path, ranks=[0])
    assert (tmp_path / "rank0.dot").exists() and not (tmp_path / "rank0.svg").exists()
    assert "dot -Tsvg" in result.note and capsys.readouterr().err.count("\n") == 1


def test_cost_report_adds_up() -> None:
    from autopar.cost_model.comm import shared_cores_time

    dist = dp_mp()
    cost = dist.cost
    for r in cost.ranks:
        assert r.comm_bytes == sum(c.bytes for c in dist.comm_ops(r.rank))
        # each collective alone, and its fixed costs stretched where the 4 processes share the cores
        alone = sum(c.time for c in dist.comm_ops(r.rank))
        shared = sum(shared_cores_time(c.kind.value, c.group, dist.state.cluster, 4) for c in dist.comm_ops(r.rank))
        assert r.comm_time == pytest.approx(alone + shared)
        assert r.compute_time > 0 and r.memory.activations > 0
    # linear_0.w_0 [8,16] is split over mp: 64 floats of it on each rank; its momentum velocity the same
    assert cost.ranks[0].memory.parameters < sum(4 * v.shape[0] * (v.shape[1] if len(v.shape) > 1 else 1)
                                                 for v in dist.graph.values.values() if v.kind == "parameter")  # fmt: skip
    text = str(cost)
    assert "step time (slowest rank)" in text and "peak mem" in text
    assert cost_report(dist).step_time == cost.step_time


def test_cli_explain_and_diff_end_to_end(tmp_path: Path) -> None:
    target = f"{ROOT}/examples/inspect_models.py:simple_net_dp_mp"
    cli = [sys.executable, "-m", "autopar.cli"]
    out = subprocess.run([*cli, "explain", target], capture_output=True, text=True, timeout=120, check=True).stdout
    for section in ("placements (per mesh dim", "collectives: 2 (8 over all ranks)", "conflict report:",
                    "pipeline schedule: no pipeline", "step time (slowest rank)"):  # fmt: skip
        assert section in out
    assert "linear_0.w_0  parameter" in out
    done = subprocess.run([*cli, "diff", target, "--out", str(tmp_path), "--ranks", "0", "--no-svg"],
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    assert "wrote 1 diffs" in done.stdout and (tmp_path / "rank0.diff").read_text().startswith("--- serial program")


def test_cli_reports_a_bad_target() -> None:
    from autopar.cli import main

    assert main(["explain", "no_such_file.py"]) == 2
