"""``DistributedProgram.dump_diff``: per-rank text diffs and graphviz pictures (stage: inspection).

For each rank ``r`` it writes ``rank{r}.diff`` (:mod:`autopar.inspect.diff`), ``rank{r}.dot``
and, where graphviz ``dot`` is installed, ``rank{r}.svg`` (:mod:`autopar.inspect.render`); for a
pipeline also ``schedule.svg``, the schedule's modelled timeline.
Without ``dot`` it still writes the ``.dot`` files and says in one line how to render them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopar.inspect.diff import diff_lines, diff_text
from autopar.inspect.render import dot_available, render_dot, render_svg
from autopar.inspect.view import rank_view

NO_DOT = "graphviz 'dot' not found: wrote .dot files only; render with `dot -Tsvg {dir}/rank0.dot -o {dir}/rank0.svg` (apt-get install graphviz)"


@dataclass
class DumpResult:
    """What :func:`dump_diff` wrote."""

    directory: Path
    diffs: dict[int, Path] = field(default_factory=dict)
    dots: dict[int, Path] = field(default_factory=dict)
    svgs: dict[int, Path] = field(default_factory=dict)
    note: str = ""  # set when the SVGs could not be rendered
    schedule: Path | None = None  # the pipeline's modelled timeline (schedule.svg), if pipelined

    def __str__(self) -> str:
        files = len(self.diffs) + len(self.dots) + len(self.svgs) + (self.schedule is not None)
        return f"wrote {files} files to {self.directory}" + (f"\n{self.note}" if self.note else "")


def dump_diff(
    dist: Any,
    directory: str | Path,
    ranks: Iterable[int] | None = None,
    context: int | None = None,
    collapse: bool | None = None,
    layer: str | None = None,
    svg: bool = True,
    after: str | None = None,
) -> DumpResult:
    """Write the diff and the picture of every rank program of ``dist`` into ``directory``.

    ``context``: unchanged ops kept around each change in the text diff (None: the whole
    program). ``collapse``: fold layers and repeated layers in the picture (None: when the
    program has more than 120 ops). ``layer``: draw only the ops of that layer
    (``struct_name``, e.g. ``"Linear_1"``) into ``rank{r}.{layer}.dot``. ``after``: the rank
    programs as they are after the pass of that name (``print(dist.passes)`` lists them); the
    files are then named ``rank{r}.after-{pass}.*``.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    result = DumpResult(out)
    render = svg and dot_available()
    for rank in sorted(ranks if ranks is not None else dist.mesh.ranks):
        view = rank_view(dist, rank, after)
        stem = f"rank{rank}" + (f".after-{after}" if after else "")
        path = out / f"{stem}.diff"
        if context is None:
            path.write_text(diff_text(dist, rank, after=after))
        else:
            head = diff_text(dist, rank, after=after).splitlines()[:2]
            path.write_text("\n".join(head + diff_lines(view, context)) + "\n")
        result.diffs[rank] = path
        suffix = f".{_safe(layer)}" if layer else ""
        title = f"rank {rank} of {dist.mesh}" + (f" — layer {layer}" if layer else "")
        dot_path = out / f"{stem}{suffix}.dot"
        dot_path.write_text(render_dot(view, title, collapse=collapse, layer=layer))
        result.dots[rank] = dot_path
        if render:
            result.svgs[rank] = render_svg(dot_path)
    if dist.decisions.pipeline() is not None:  # drawn without graphviz
        result.schedule = _schedule_svg(dist, out / "schedule.svg")
    if svg and not render:
        result.note = NO_DOT.format(dir=out)
        print(result.note, file=sys.stderr)
    return result


def _schedule_svg(dist: Any, path: Path) -> Path:
    """The pipeline schedule timed with modelled action times (F = 1, B = 2), one row per
    pipeline rank (``Executor.timeline()`` gives the measured one)."""
    from autopar.schedule_timeline import render_svg as render_timeline
    from autopar.schedule_timeline import simulate_timeline

    plan = dist.decisions.pipeline()
    timeline = simulate_timeline({rank: list(actions) for rank, actions in enumerate(plan.actions)})
    path.write_text(render_timeline(timeline, f"{plan.schedule}, {plan.micro_batches} micro-batches (modelled)"))
    return path


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
