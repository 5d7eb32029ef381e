"""Timelines of pipeline schedules (stage: pipeline scheduling).

Exists to judge a schedule before it runs: :func:`simulate_timeline` times a verified schedule of
:mod:`autopar.schedule` with modelled action durations (through :func:`autopar.schedule.replay`,
the one simulator) and reports, per rank, the start and end of every action, the peak number of
stashed micro-batches and the peak activation bytes, and overall the makespan and the bubble
fraction; :func:`render_svg` draws the timeline as a dependency-free SVG, ``print`` shows it as a
table (per rank: busy and idle time, peak stash, each action's start and end).

Stashed micro-batch: on one stage, its forward done and its first backward (B or I; W on a stage
that makes no input gradient) not yet; a rank's stash sums its stages. Bubble fraction: the time ranks spend outside compute
actions (F, B, I, W, OPTIMIZER; waiting and transfers count as bubble) over ``ranks x makespan``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from xml.sax.saxutils import escape, quoteattr

from autopar.schedule import (
    COMPUTE_KINDS,
    INPUT_GRAD_KINDS,
    OPTIMIZER,
    Action,
    ActionKind,
    ScheduleError,
    replay,
)
from autopar.text_table import text_table
from autopar.units import format_bytes

# Modelled durations: a full backward costs two forwards (input and weight gradient, one each);
# sends, recvs and the optimizer take no time unless given.
DEFAULT_DURATIONS: Mapping[ActionKind, float] = MappingProxyType(
    {ActionKind.F: 1.0, ActionKind.B: 2.0, ActionKind.I: 1.0, ActionKind.W: 1.0}
)
BUSY_KINDS = COMPUTE_KINDS | {OPTIMIZER}
COLOURS = {"F": "#8cb4e0", "B": "#f4a582", "I": "#fdd49e", "W": "#a6d96a", "OPT": "#c7c7c7"}


@dataclass(frozen=True, slots=True)
class Span:
    """One action of one rank and when it runs."""

    action: Action
    start: float
    end: float

    def __str__(self) -> str:
        return f"{self.action}@[{self.start:g}, {self.end:g})"


@dataclass(frozen=True, slots=True)
class Timeline:
    """A simulated step: per rank (the tuple index) its spans in program order, and the statistics."""

    spans: tuple[tuple[Span, ...], ...]
    makespan: float
    bubble_fraction: float
    peak_stash: tuple[int, ...]  # per rank: peak number of stashed micro-batches (summed over its stages)
    peak_activation_bytes: tuple[int, ...] | None  # per rank, when bytes per stashed micro-batch were given
    measured: bool = False  # times in seconds as a step ran (``Executor.timeline()``), else modelled units

    @property
    def num_ranks(self) -> int:
        return len(self.spans)

    def busy(self, rank: int) -> float:
        """Time ``rank`` spent in compute actions (of a measured step: in every span it ran)."""
        return sum(s.end - s.start for s in self.spans[rank] if self.measured or s.action.kind in BUSY_KINDS)

    def __str__(self) -> str:
        """A table: per rank its busy and idle time, peak stash and each action with its start and end."""
        scale, unit = _clock(self.makespan) if self.measured else (1.0, "")
        at = (lambda t: f"{t * scale:.3g}{unit}") if self.measured else (lambda t: f"{t:g}")
        how = "measured" if self.measured else "modelled: F = 1, B = 2 unless given"
        lines = [f"pipeline step ({how}): {self.num_ranks} ranks, makespan {at(self.makespan)}, "
                 f"bubble {self.bubble_fraction:.1%}"]  # fmt: skip
        head = ("rank", "busy", "idle", "peak stash", *(("peak activations",) if self.peak_activation_bytes else ()),
                f"actions@start-end{' (' + unit + ')' if unit else ''}")  # fmt: skip
        rows = [head]
        for rank, spans in enumerate(self.spans):
            busy = self.busy(rank)
            memory = (format_bytes(self.peak_activation_bytes[rank]),) if self.peak_activation_bytes else ()
            actions = ", ".join(f"{s.action}@{s.start * scale:.3g}-{s.end * scale:.3g}" for s in spans)
            rows.append((str(rank), at(busy), at(self.makespan - busy), str(self.peak_stash[rank]), *memory, actions))
        return "\n".join(lines + text_table(rows, "  "))


def simulate_timeline(
    schedule: Mapping[int, list[Action]],
    durations: Mapping[ActionKind, float] | None = None,
    activation_bytes: Mapping[int, int] | None = None,
) -> Timeline:
    """Time a schedule that :func:`autopar.schedule.verify` accepted.

    ``durations`` per action kind override :data:`DEFAULT_DURATIONS` (kinds not named keep their
    default). ``activation_bytes``: per stage, the bytes one stashed micro-batch holds; with it the
    timeline also reports each rank's peak activation bytes.
    """
    for kind, seconds in (durations or {}).items():
        if not isinstance(kind, ActionKind) or not _is_duration(seconds):
            raise ScheduleError(f"durations map ActionKind to a finite time >= 0, got {kind!r}: {seconds!r}")
    stages = {action.stage for actions in schedule.values() for action in actions}
    if activation_bytes is not None and (missing := sorted(stages - set(activation_bytes))):
        raise ScheduleError(f"activation_bytes gives no bytes for stages {missing}")
    times = replay(schedule, {**DEFAULT_DURATIONS, **(durations or {})})
    spans = tuple(
        tuple(Span(action, start, end) for action, (start, end) in zip(schedule[rank], times[rank]))
        for rank in sorted(schedule)
    )
    makespan = max((rank_spans[-1].end for rank_spans in spans if rank_spans), default=0.0)
    busy = sum(span.end - span.start for rank_spans in spans for span in rank_spans if span.action.kind in BUSY_KINDS)
    bubble = 1.0 - busy / (len(spans) * makespan) if makespan > 0 else 0.0
    peaks = [_peak_stash(schedule[rank], activation_bytes or {}) for rank in sorted(schedule)]
    return Timeline(
        spans=spans,
        makespan=makespan,
        bubble_fraction=bubble,
        peak_stash=tuple(count for count, _ in peaks),
        peak_activation_bytes=None if activation_bytes is None else tuple(nbytes for _, nbytes in peaks),
    )


def measured_timeline(spans: Mapping[int, list[Span]]) -> Timeline:
    """The :class:`Timeline` of a step that ran: each rank's compute spans as measured (one
    monotonic clock for all ranks of the machine), shifted to start at 0. Idle time, transfers
    included, is bubble."""
    start = min((s.start for rank_spans in spans.values() for s in rank_spans), default=0.0)
    shifted = tuple(
        tuple(Span(s.action, s.start - start, s.end - start) for s in spans[rank]) for rank in sorted(spans)
    )
    makespan = max((s.end for rank_spans in shifted for s in rank_spans), default=0.0)
    busy = sum(s.end - s.start for rank_spans in shifted for s in rank_spans)
    peaks = [_peak_stash([s.action for s in rank_spans], {})[0] for rank_spans in shifted]
    bubble = 1.0 - busy / (len(shifted) * makespan) if makespan > 0 else 0.0
    return Timeline(shifted, makespan, bubble, tuple(peaks), None, measured=True)


def _clock(makespan: float) -> tuple[float, str]:
    """The unit a measured step's times print in: the largest that keeps the makespan >= 1."""
    for scale, unit in ((1.0, "s"), (1e3, "ms"), (1e6, "us")):
        if makespan * scale >= 1:
            return scale, unit
    return 1e9, "ns"


def _is_duration(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _peak_stash(actions: list[Action], activation_bytes: Mapping[int, int]) -> tuple[int, int]:
    """Peak stashed micro-batches and peak activation bytes over one rank's program order."""
    stash: Counter[int] = Counter()  # stage -> stashed micro-batches
    released: set[tuple[int, int]] = set()
    peak_count = peak_bytes = 0
    for action in actions:
        if action.kind is ActionKind.F:
            stash[action.stage] += 1
        elif action.kind in INPUT_GRAD_KINDS | {ActionKind.W} and (action.stage, action.micro_batch) not in released:
            # (its first backward; a W first when the stage has no input gradient to make: the
            # first stage of a zero-bubble schedule, whose I runs nothing and records no span)
            released.add((action.stage, action.micro_batch))
            stash[action.stage] -= 1
        peak_count = max(peak_count, sum(stash.values()))
        peak_bytes = max(peak_bytes, sum(n * activation_bytes.get(stage, 0) for stage, n in stash.items()))
    return peak_count, peak_bytes


# ---- picture -------------------------------------------------------------------------------

_LEFT, _TOP, _ROW, _GAP, _WIDTH = 70, 40, 26, 6, 900


def render_svg(timeline: Timeline, title: str = "pipeline schedule") -> str:
    """A standalone SVG: one row per rank, a labelled box per compute action, the bubble in the title.

    Boxes are coloured per kind; on ranks holding several stages, later model chunks are paler.
    Hovering a box shows the full action (``2F3``) and its times.
    """
    heading = (
        f"{title}: {timeline.num_ranks} ranks, makespan {timeline.makespan:g}, bubble {timeline.bubble_fraction:.1%}"
    )
    scale = _WIDTH / timeline.makespan if timeline.makespan > 0 else 1.0
    height = _TOP + timeline.num_ranks * (_ROW + _GAP) + 30
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_LEFT + _WIDTH + 20}" height="{height}" '
        'font-family="sans-serif" font-size="11">',
        f"<title>{escape(heading)}</title>",
        f'<text x="8" y="22" font-size="14">{escape(heading)}</text>',
    ]
    for rank, spans in enumerate(timeline.spans):
        parts += _rank_row(rank, spans, _TOP + rank * (_ROW + _GAP), scale, timeline.num_ranks)
    kinds = sorted({span.action.kind.value for spans in timeline.spans for span in spans if _drawn(span)})
    parts += _legend(kinds, height - 14)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _drawn(span: Span) -> bool:
    return span.action.kind in BUSY_KINDS and span.end > span.start


def _rank_row(rank: int, spans: tuple[Span, ...], y: int, scale: float, num_ranks: int) -> list[str]:
    parts = [f'<text x="8" y="{y + _ROW * 0.65:.1f}">rank {rank}</text>']
    for span in filter(_drawn, spans):
        action = span.action
        x, width = _LEFT + span.start * scale, (span.end - span.start) * scale
        label = f"{action.kind.value}{'' if action.micro_batch is None else action.micro_batch}"
        opacity = 1.0 if (action.stage // num_ranks) % 2 == 0 else 0.55
        tip = escape(f"{action} [{span.start:g}, {span.end:g})")
        parts.append(
            f'<rect x="{x:.2f}" y="{y}" width="{width:.2f}" height="{_ROW}" fill={quoteattr(COLOURS[action.kind.value])} '
            f'fill-opacity="{opacity}" stroke="#333" stroke-width="0.5"><title>{tip}</title></rect>'
        )
        if width >= 7 * len(label):
            parts.append(f'<text x="{x + width / 2:.2f}" y="{y + _ROW * 0.65:.1f}" text-anchor="middle">{label}</text>')
    return parts


def _legend(kinds: list[str], y: int) -> list[str]:
    parts = []
    for index, kind in enumerate(kinds):
        x = _LEFT + index * 60
        parts.append(
            f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill={quoteattr(COLOURS[kind])} stroke="#333"/>'
        )
        parts.append(f'<text x="{x + 16}" y="{y}">{kind}</text>')
    return parts
