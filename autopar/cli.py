"""The ``autopar`` command line: explain a compiled program, write its per-rank dumps
(stage: inspection).

    autopar explain TARGET            placements, collectives with costs, conflicts, pipeline,
                                      predicted memory and step time
    autopar diff TARGET --out DIR     per-rank text diffs and graphviz pictures into DIR
    autopar check TARGET              where the distributed run first differs from serial, op by
                                      op, on random feeds (exit 0 when every value equals, 1 not)

How TARGET hands over its program (see docs/debugging.md):

* ``module:function`` or ``path/to/file.py:function`` — the function is called without
  arguments and returns a :class:`~autopar.DistributedProgram`, or a tuple
  ``(main_program, mesh[, startup_program[, strategy]])`` that the CLI compiles (annotate the
  program with ``autopar.shard_tensor`` before returning it).
* ``path/to/file.py`` — the script is run (``__name__`` is not ``"__main__"``, its prints go
  to stderr); it leaves the same object in a module-level variable ``autopar_program``, or
  exactly one module-level DistributedProgram.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import runpy
import sys
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError
from autopar.units import parse_bytes  # (the CLI's --memory; suggest's memory_per_rank reads it too)

HANDOVER = """TARGET hands over its program:
  module:function | file.py:function   the function (no arguments) returns a DistributedProgram
                                       or (main_program, mesh[, startup_program[, strategy]])
  file.py                              the script leaves one of those in a module-level variable
                                       `autopar_program` (or defines exactly one DistributedProgram)
"""


def load_target(target: str) -> Any:
    """The DistributedProgram ``target`` builds (compiling a returned program tuple)."""
    return _as_distributed(_handed_over(target), target)


def _handed_over(target: str) -> Any:
    """What ``target`` hands over, its prints sent to stderr (stdout carries the report)."""
    with contextlib.redirect_stdout(sys.stderr):
        return _load(target)


def _load(target: str) -> Any:
    path, _, func = target.rpartition(":") if ":" in target else (target, "", "")
    if not func:
        if not Path(target).is_file():
            raise AutoparError(f"{target!r}: no such script; expected file.py, file.py:function or module:function")
        namespace = runpy.run_path(target, run_name="__autopar__")
        if "autopar_program" in namespace:
            return namespace["autopar_program"]
        from autopar.distributed_program import DistributedProgram

        found = [v for k, v in namespace.items() if isinstance(v, DistributedProgram) and not k.startswith("_")]
        if len(found) != 1:
            raise AutoparError(f"{target}: define `autopar_program` (found {len(found)} DistributedProgram variables)")
        return found[0]
    if path.endswith(".py") or Path(path).is_file():
        spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        if spec is None or spec.loader is None:
            raise AutoparError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(Path(path).resolve().parent))
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(path)
    if not hasattr(module, func):
        raise AutoparError(f"{path} has no function {func!r}")
    return getattr(module, func)()


def _as_distributed(obj: Any, target: str) -> Any:
    import autopar

    if isinstance(obj, autopar.DistributedProgram):
        return obj
    if isinstance(obj, tuple) and 2 <= len(obj) <= 4:
        main, mesh, *rest = obj
        startup = rest[0] if rest else None
        strategy = rest[1] if len(rest) > 1 else None
        return autopar.compile(main, mesh, startup_program=startup, strategy=strategy)
    raise AutoparError(
        f"{target} gave a {type(obj).__name__}; expected a DistributedProgram or (main, mesh[, startup])"
    )


# ---- explain ---------------------------------------------------------------------------
def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def key_activations(dist: Any) -> list[Any]:
    """Feeds, layer outputs (a forward value leaving its layer), resharded values, the loss."""
    from autopar.graph import Role

    graph = dist.decisions.serial()
    resharded = {r.key for r in dist.decisions.reshards()}
    forward = [
        op for op in graph.ops if op.role is Role.FORWARD and op.name not in ("pd_op.full_int_array", "pd_op.full")
    ]
    keys = []
    for op in forward:
        for key in op.outputs:
            if key is None or graph.values[key].kind not in ("activation", "feed"):
                continue
            value = graph.values[key]
            layer = op.layer
            leaves = layer and any(graph.ops[u].layer != layer for u in value.users)
            if value.kind == "feed" or leaves or key in resharded:
                keys.append(key)
    last = next((k for op in reversed(forward) for k in op.outputs if k is not None), None)
    if last is not None and last not in keys:
        keys.append(last)
    return keys


def placement_lines(dist: Any) -> list[str]:
    decisions, rank0 = dist.decisions, dist.mesh.ranks[0]
    rows = [("tensor", "kind", "made by", "shape", "placement", f"local on rank {rank0}")]

    def row(value: Any) -> tuple[str, ...]:
        attr = value.placement
        local = str(list(attr.local_shape(value.shape, rank0))) if rank0 in attr.mesh.ranks else "-"
        made = "-" if value.kind in ("parameter", "feed") else value.producer.split(".", 1)[-1] + (f" ({value.layer})" if value.layer else "")
        return decisions.serial().values[value.key].label, value.kind, made, str(list(value.shape)), str(attr), local

    rows += [row(v) for v in decisions.values(("parameter",))]
    rows += [row(decisions.value(k)) for k in key_activations(dist)]
    return [f"placements (per mesh dim {list(dist.mesh.dim_names)}):", *_table(rows)]


def collective_lines(dist: Any) -> list[str]:
    """Every collective, merged over ranks that run the same one in different groups."""
    from autopar.collective_kinds import kind_of
    from autopar.units import format_bytes, format_time

    merged: dict[tuple, list[tuple[int, ...]]] = {}
    for rank in dist.mesh.ranks:
        for c in dist.comm_ops(rank):
            key = (c.kind, c.reduce if kind_of(c.kind).reduces else "", c.value, str(c.src),
                   str(c.dst), c.bytes, c.dtype, c.time, c.reason)  # fmt: skip
            groups = merged.setdefault(key, [])
            if c.group not in groups:
                groups.append(c.group)
    total = sum(len(dist.comm_ops(r)) for r in dist.mesh.ranks)
    lines = [f"collectives: {len(merged)} ({total} over all ranks)"]
    for (kind, reduce, value, src, dst, nbytes, dtype, time, reason), groups in merged.items():
        name = f"{kind}({reduce})" if reduce else kind
        where = " ".join(str(list(g)) for g in groups)
        lines.append(
            f"  {name:<20} {value:<18} {src} -> {dst}  groups {where}  {format_bytes(nbytes)} {dtype}  {format_time(time)}"
        )
        lines.append(f"  {'':<20} why: {reason}")
    return lines


def pipeline_lines(dist: Any) -> list[str]:
    """Each pipeline rank's verified schedule and its modelled bubble (F = 1, B = 2)."""
    plan = dist.decisions.pipeline()
    if plan is None:
        return ["pipeline schedule: no pipeline"]
    from autopar.schedule_timeline import simulate_timeline

    timeline = simulate_timeline({r: list(a) for r, a in enumerate(plan.actions)})
    lines = [
        f"pipeline: {len(plan.stages)} stages on {len(plan.meshes)} sub-meshes, {plan.micro_batches} micro-batches, "
        f"{plan.schedule}; modelled bubble {timeline.bubble_fraction:.1%} (F = 1, B = 2), peak stash per rank "
        f"{list(timeline.peak_stash)}"
    ]
    for rank, actions in enumerate(plan.actions):
        lines.append(f"  {plan.meshes[rank]}: {' '.join(map(str, actions))}")
    for shared in plan.shared:
        copies = f"; the updated value replaces the copy on {', '.join(map(str, shared.copies))} once per step" if shared.copies else \
            "; sharded: the other stages receive it at each read"
        lines.append(f"  shared parameter {shared.name}: read on {len(shared.readers)} stages, updated on {shared.owner}{copies}")
    return lines


def region_lines(dist: Any) -> list[str]:
    """Where a split value is gathered because the op reading it has no SPMD rule: where a
    parallel region ends, and why (add a rule, or annotate around the op)."""
    from autopar.collective_kinds import kind_of

    unsupported = set(dist.report.unsupported_ops)
    lines = []
    for reshard in dist.decisions.reshards():
        kinds = set(reshard.kinds)
        if reshard.op in unsupported and any(kind_of(k).makes_whole for k in kinds):
            lines.append(
                f"  {reshard.value} {reshard.have} is made whole ({', '.join(sorted(kinds))}) "
                f"for {reshard.op}: it has no SPMD rule, so it runs replicated"
            )
    return ["parallel regions end (ops without an SPMD rule):", *lines, ""] if lines else []


def sequence_lines(dist: Any) -> list[str]:
    """Sequence parallelism: the activations split along the sequence, and the region's edges."""
    regions = dist.decisions.sequence()
    if regions is None:
        return []
    axis = regions.axis
    split = [v for v in regions.values if v.seq_dim is not None]
    edges = [v for v in regions.values if v.seq_dim is None]
    lines = [f"sequence parallel over {axis!r}: {len(split)} activations split along the sequence"]
    lines += [f"  {v.label}: dim {v.seq_dim} ({v.why})" for v in split]
    lines += [f"  {v.label}: whole on {axis!r} ({v.why})" for v in edges]
    return [*lines, ""]


def zero_lines(dist: Any) -> list[str]:
    """ZeRO's decision per parameter update (empty without ZeRO)."""
    zero = dist.decisions.zero()
    if not zero:
        return []
    return [f"ZeRO stage {dist.strategy.zero_stage}:", *(f"  {z}" for z in zero), ""]


def dead_op_lines(dist: Any) -> list[str]:
    """The ops removed before analysis because nothing reads their results (empty if none)."""
    text = dict(dist.decisions.rewrites()).get("dead_ops", "no dead op")
    return [] if text == "no dead op" else [text, ""]


def context_parallel_lines(dist: Any) -> list[str]:
    """What context parallelism split (the feeds, the heads around attention cores; empty if off)."""
    text = dict(dist.decisions.rewrites()).get("context_parallel")
    return [] if text is None else [f"context parallel: {text}", ""]


def explain_text(dist: Any, target: str = "") -> str:
    lines = [
        f"autopar explain {target}".rstrip(),
        f"mesh {dist.mesh}, {dist.world_size} ranks, {len(dist.decisions.ops())} serial ops",
        "",
    ]
    lines += dead_op_lines(dist) + context_parallel_lines(dist)
    lines += placement_lines(dist) + [""]
    unavailable = dist.unavailable
    if unavailable:
        lines += [f"collectives: not planned per rank ({unavailable})", ""]
    else:
        lines += collective_lines(dist) + [""]
    lines += ["conflict report:", *("  " + line for line in str(dist.report).splitlines()), ""]
    lines += region_lines(dist)
    lines += pipeline_lines(dist) + [""]
    lines += zero_lines(dist)
    lines += sequence_lines(dist)
    lines.append(str(dist.cost) if not unavailable else f"cost: not available ({unavailable})")
    return "\n".join(lines) + "\n"


# ---- entry point -----------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopar", description="Inspect what autopar compiled.", epilog=HANDOVER,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    explain = sub.add_parser("explain", help="placements, collectives, conflicts, pipeline, memory and step time",
                             epilog=HANDOVER, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    explain.add_argument("target", help="file.py, file.py:function or module:function")
    diff = sub.add_parser("diff", help="write per-rank text diffs and graphviz pictures",
                          epilog=HANDOVER, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    diff.add_argument("target", help="file.py, file.py:function or module:function")
    diff.add_argument("--out", required=True, help="directory for rank{r}.diff / .dot / .svg")
    diff.add_argument("--ranks", type=int, nargs="*", help="only these ranks (default: all)")
    diff.add_argument("--context", type=int, default=None, help="unchanged ops kept around changes (default: all)")
    diff.add_argument("--collapse", action=argparse.BooleanOptionalAction, default=None,
                      help="fold layers and repeated layers in the pictures (default: above 120 ops)")  # fmt: skip
    diff.add_argument("--layer", help="draw only this layer (struct_name, e.g. Linear_1)")
    diff.add_argument("--no-svg", action="store_true", help="write .dot files only")
    check = sub.add_parser("check", help="where the distributed run first differs from serial, op by op (exit 1 if it does)",
                           epilog=HANDOVER, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    check.add_argument("target", help="file.py, file.py:function or module:function")
    check.add_argument("--steps", type=int, default=1, help="training steps compared (default 1)")
    check.add_argument("--seed", type=int, default=0, help="seed of the random feeds (default 0)")
    check.add_argument("--int-high", type=int, default=2,
                       help="integer feeds (token ids, labels) are drawn below this (default 2: valid for any model)")  # fmt: skip
    suggest = sub.add_parser("suggest", help="the best plans for a program on N devices, ranked and explained",
                             epilog=HANDOVER, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    suggest.add_argument("target", help="file.py, file.py:function or module:function giving (main, startup) (a mesh is ignored)")
    suggest.add_argument("--world", type=int, required=True, help="number of devices")
    suggest.add_argument("--memory", help="memory per device, e.g. 80GB or 512MiB (default: the profile's device memory)")
    suggest.add_argument("--profile", help="cost profile name or JSON path (default: the hardware in use)")
    suggest.add_argument("--top", type=int, default=5, help="plans shown (default 5)")
    suggest.add_argument("--all-devices", action="store_true", help="only plans that use every device (default: "
                         "plans on fewer devices too, when the world does not divide the program well)")  # fmt: skip
    return parser


def suggest_text(target: str, world: int, memory: str | None, profile: str | None, top: int, all_devices: bool = False) -> str:
    """``autopar suggest``: the ranked table and the best plan's why."""
    import autopar

    obj = _handed_over(target)
    if isinstance(obj, autopar.DistributedProgram):
        main, startup = obj.serial_program, obj.serial_startup_program
    elif isinstance(obj, tuple) and 1 <= len(obj) <= 4:
        rest = [x for x in obj[1:] if not isinstance(x, (autopar.ProcessMesh, autopar.Strategy))]
        main, startup = obj[0], rest[0] if rest else None
    else:
        raise AutoparError(f"{target} gave a {type(obj).__name__}; expected a DistributedProgram or (main[, mesh], startup)")
    budget = parse_bytes(memory) if memory is not None else None
    plans = autopar.suggest(main, world, startup, memory_per_rank=budget, cluster=profile, top=top, all_devices=all_devices)
    return str(plans) + "\n"


def main(argv: list[str] | None = None) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "suggest":
            sys.stdout.write(suggest_text(args.target, args.world, args.memory, args.profile, args.top, args.all_devices))
            return 0
        dist = load_target(args.target)
        if args.command == "explain":
            sys.stdout.write(explain_text(dist, args.target))
        elif args.command == "check":
            from autopar.inspect.check import check, random_feeds

            report = check(dist, random_feeds(dist, args.steps, args.seed, args.int_high))
            print(report)
            return 0 if report.clean else 1
        else:
            result = dist.dump_diff(args.out, ranks=args.ranks, context=args.context, collapse=args.collapse,
                                    layer=args.layer, svg=not args.no_svg)  # fmt: skip
            print(
                f"wrote {len(result.diffs)} diffs, {len(result.dots)} .dot and {len(result.svgs)} .svg files to {args.out}"
            )
    except AutoparError as error:
        print(f"autopar: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
