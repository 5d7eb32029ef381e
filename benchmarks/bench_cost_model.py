"""Measured vs predicted collective times on this machine (gloo, 2 and 4 processes), and the
reshard planner's choices measured on 4 processes.

**Accuracy.** Each world size runs one set of worker processes that time every collective, in
rounds spread over the run (a burst of load from elsewhere hits every kind alike; each figure
is the lower quartile over reps of the slowest rank: ``profile_fit.summary``), on two disjoint
size sets: the calibration sizes (6 KiB x 4^k, 40 MiB, 96 MiB: what
``tools/calibrate.py`` uses; all_gather also at 192 MiB, since an emulated all_to_all
gathers p times its send buffer) and the evaluation sizes (4 KiB x 4^k up to 64 MiB). The profile is fitted on the calibration samples only; the
table compares its predictions with the evaluation samples. reduce_scatter and all_to_all run
as their gloo emulations (all_reduce / all_gather of the whole send buffer plus a slice, what
the native backend's lowering runs) and are predicted as such; ``sub_all_reduce`` /
``sub_all_gather`` are collectives over ranks (0, 1) of 4 processes run the host backend's way
(a world all_gather_object, then numpy), predicted by the profile's ``world_exchange`` rule
(evaluated up to 16 MiB: at 64 MiB one exchange gathers 256 MiB per process); send/recv is
timed between 2 processes only. Targets: MAPE <= 20 % over sizes >= 1 MiB, no kind above 30 %.

**Decompositions.** On a 2 x 2 mesh, a reshard can run as one collective over both mesh dims
or as steps over one mesh dim at a time. For each case both plans (and the planner's own, if it
is neither) run on 4 processes through the host backend's communicator
(``autopar.runtime.gloo.GlooCommunicator``: world all_reduce / all_gather natively on gloo,
sub-group steps as a world exchange); the table prints measured vs predicted per plan and
whether the planner (``plan_reshard(..., cluster=load_cluster("cpu-gloo"))``) chose the plan
that measured cheaper.

    python benchmarks/bench_cost_model.py [--skip-accuracy] [--skip-decompositions]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from autopar.cost_model.cluster import load_cluster
from autopar.cost_model.comm import collective_time
from autopar.cost_model.planner import format_bytes, format_time
from autopar.cost_model.profile_fit import (
    CALIBRATION_SIZES,
    EMULATED,
    MEASURED,
    ROUNDS,
    build_profile,
    summary,
    vars_of,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # the calibration's measuring (tools/calibrate.py)
from calibrate import EXTRA_SIZES, SUBGROUP, measure, run_processes  # noqa: E402

EVALUATION_SIZES = tuple(4096 * 4**k for k in range(8))  # 4 KiB ... 64 MiB
SUBGROUP_SIZES = tuple(n for n in EVALUATION_SIZES if n <= 16 << 20)
KINDS = ("all_reduce", "all_gather", "broadcast", *EMULATED, "send_recv", *SUBGROUP)
TARGET_MAPE, TARGET_KIND_MAPE = 20.0, 30.0
DECOMPOSITION_WORLD = 4
DECOMPOSITION_SIZES = (4 << 20, 16 << 20)


# ---- accuracy ------------------------------------------------------------------------------


def measure_accuracy(worlds: tuple[int, ...]) -> list:
    assert not {*CALIBRATION_SIZES, *(n for more in EXTRA_SIZES.values() for n in more)} & set(EVALUATION_SIZES)
    both = sorted(CALIBRATION_SIZES + EVALUATION_SIZES)
    samples = []
    for world in worlds:
        sizes_of = {kind: EVALUATION_SIZES for kind in EMULATED}
        sizes_of.update(
            {kind: sorted({*both, *more}) for kind, more in EXTRA_SIZES.items()}, exchange=CALIBRATION_SIZES
        )
        kinds = [k for k in MEASURED if k != "send_recv" or world == 2] + list(EMULATED)
        if world > 2:
            kinds += list(SUBGROUP)
            sizes_of.update(dict.fromkeys(SUBGROUP, SUBGROUP_SIZES))
        samples += measure(world, both, kinds, timeout=1800, sizes_of=sizes_of)
    return samples


def predict(sample, cluster) -> float:
    if sample.kind in SUBGROUP:
        return collective_time(SUBGROUP[sample.kind], (0, 1), sample.nbytes, cluster, world_size=sample.world)
    group = (0, 1) if sample.kind == "send_recv" else tuple(range(sample.world))
    return collective_time(sample.kind, group, sample.nbytes, cluster)


def report_accuracy(samples: list, worlds: tuple[int, ...]) -> bool:
    calibration = [s for s in samples if s.nbytes not in EVALUATION_SIZES]
    device = load_cluster("cpu-gloo").device  # measured now, on a busy machine, a slice would look slow
    cluster = build_profile(calibration, worlds, CALIBRATION_SIZES, device)
    rows = []
    print(f"{'collective':>15} {'procs':>5} {'size':>10} {'measured':>10} {'predicted':>10} {'error':>7}")
    order = {kind: i for i, kind in enumerate(KINDS)}
    for s in sorted(samples, key=lambda s: (s.world, order.get(s.kind, 99), s.nbytes)):
        if s.nbytes not in EVALUATION_SIZES or s.kind not in order:
            continue
        predicted = predict(s, cluster)
        error = (predicted - s.seconds) / s.seconds
        rows.append((s, error))
        print(f"{s.kind:>15} {s.world:>5} {format_bytes(s.nbytes):>10} {format_time(s.seconds):>10} "
              f"{format_time(predicted):>10} {100 * error:>6.1f}%")  # fmt: skip

    def mape(selected: list) -> float:
        return 100 * sum(abs(e) for _, e in selected) / max(len(selected), 1)

    big = [(s, e) for s, e in rows if s.nbytes >= 1 << 20]
    print(f"\nMAPE per kind, sizes >= 1 MiB (target: none above {TARGET_KIND_MAPE:.0f}%):")
    print(f"{'collective':>15} {'2 procs':>8} {'4 procs':>8} {'both':>8} {'points':>7}")
    worst = 0.0
    for kind in KINDS:
        mine = [r for r in big if r[0].kind == kind]
        if not mine:
            continue
        by_world = [
            mape([r for r in mine if r[0].world == w]) if any(r[0].world == w for r in mine) else None for w in (2, 4)
        ]
        cells = " ".join(f"{'-':>7} " if m is None else f"{m:>7.1f}%" for m in by_world)
        print(f"{kind:>15} {cells} {mape(mine):>7.1f}% {len(mine):>7}")
        worst = max(worst, mape(mine))
    overall = mape(big)
    print(f"\nMAPE, all sizes: {mape(rows):.1f}% ({len(rows)} points)")
    for world in worlds:
        print(f"MAPE, sizes >= 1 MiB, {world} processes: {mape([r for r in big if r[0].world == world]):.1f}%")
    print(f"MAPE, sizes >= 1 MiB: {overall:.1f}% ({len(big)} points; target <= {TARGET_MAPE:.0f}%)")
    met = overall <= TARGET_MAPE and worst <= TARGET_KIND_MAPE
    print(f"accuracy targets {'met' if met else 'NOT met'} (worst kind {worst:.1f}%)")
    return met


# ---- decompositions ------------------------------------------------------------------------

# case: (name, src, dst, {candidate: [(kind, mesh_dims, placement after the step), ...]}); placements
# as DistAttr arguments on the 2 x 2 mesh: (dims_mapping, partial mesh dims)
CASES = (
    ("partial -> replicate", ([-1, -1], (0, 1)), ([-1, -1], ()), {
        "one all_reduce": [("all_reduce", (0, 1), ([-1, -1], ()))],
        "RS x, AR y, AG x": [("reduce_scatter", (0,), ([0, -1], (1,))), ("all_reduce", (1,), ([0, -1], ())),
                             ("all_gather", (0,), ([-1, -1], ()))],
    }),
    ("shard(0) over x,y -> replicate", ([[0, 1], -1], ()), ([-1, -1], ()), {
        "one all_gather": [("all_gather", (0, 1), ([-1, -1], ()))],
        "AG y, AG x": [("all_gather", (1,), ([0, -1], ())), ("all_gather", (0,), ([-1, -1], ()))],
    }),
    ("partial -> shard(0) on x", ([-1, -1], (0, 1)), ([0, -1], ()), {
        "one all_reduce + slice": [("all_reduce", (0, 1), ([-1, -1], ())), ("slice", (0,), ([0, -1], ()))],
        "RS x, AR y": [("reduce_scatter", (0,), ([0, -1], (1,))), ("all_reduce", (1,), ([0, -1], ()))],
    }),
)  # fmt: skip


def _mesh():
    import autopar

    return autopar.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])


def _attr(mesh, spec):
    import autopar

    mapping, partial = spec
    return autopar.DistAttr(mesh, mapping, partial_dims=set(partial))


def candidate_plans(case, shape, cluster) -> dict:
    """Every candidate of ``case`` as the planner's own steps (edges of its search graph, priced
    by it), plus the planner's plan under "planner" when it is none of them."""
    from autopar.cost_model import ReshardPlan, plan_reshard
    from autopar.cost_model.planner import _edges, _Problem

    name, src_spec, dst_spec, paths = case
    mesh = _mesh()
    src, dst = _attr(mesh, src_spec), _attr(mesh, dst_spec)
    problem = _Problem(mesh, tuple(shape), 4, ("sum",), cluster)
    plans = {}
    for label, path in paths.items():
        state, steps = src, []
        for kind, dims, after in path:
            target = _attr(mesh, after)
            (step,) = [e for e in _edges(problem, state) if e.kind == kind and e.mesh_dims == dims and e.dst == target]
            steps.append(step)
            state = target
        assert state == dst, (name, label)
        plans[label] = ReshardPlan(src, dst, tuple(shape), "float32", tuple(steps))
    chosen = plan_reshard(src, dst, shape, "float32", cluster)
    match = [label for label, plan in plans.items() if plan.steps == chosen.steps]
    if not match:
        plans["planner"] = chosen
    return {"plans": plans, "chosen": match[0] if match else "planner"}


def decomposition_worker(out: str) -> None:
    """One of 4 processes: run every candidate plan through the host backend's communicator."""
    import numpy as np

    from autopar.collective import Collective, CollectiveKey
    from autopar.runtime.gloo import GlooCommunicator

    rank, world = int(os.environ["PADDLE_TRAINER_ID"]), int(os.environ["PADDLE_TRAINERS_NUM"])
    comm = GlooCommunicator(rank, world)
    cluster = load_cluster("cpu-gloo")
    runs = []  # (case, size, label, plan)
    for case in CASES:
        for nbytes in DECOMPOSITION_SIZES:
            shape = (nbytes // 4 // 1024, 1024)
            for label, plan in candidate_plans(case, shape, cluster)["plans"].items():
                runs.append((case[0], nbytes, label, plan))

    def execute(plan) -> np.ndarray:
        x = np.ones(plan.src.local_shape(plan.shape, rank), np.float32)
        for number, step in enumerate(plan.steps):
            group = step.group_of(rank)
            if group is None:
                continue
            if step.kind == "slice":
                old, new = step.src.local_slices(plan.shape, rank), step.dst.local_slices(plan.shape, rank)
                x = x[tuple(slice(n.start - o.start, n.stop - o.start) for o, n in zip(old, new))].copy()
                continue
            job = Collective(
                kind=step.kind, group=group, key=CollectiveKey("reshard", 0, number), value="bench", src=step.src,
                dst=step.dst, shape=plan.shape, output_shape=tuple(step.dst.local_shape(plan.shape, rank)),
                bytes=step.bytes, time=step.time, reason="benchmark", reduce=step.reduce or "sum",
                axis=step.tensor_dims[0] if step.tensor_dims else 0,
            )  # fmt: skip
            x = comm.run(job, x)
        return x

    times: dict[int, list[float]] = {i: [] for i in range(len(runs))}
    checked = {}
    for _ in range(ROUNDS):  # candidates interleaved: a burst of load hits all of them alike
        for i, (_, _, _, plan) in enumerate(runs):
            result = execute(plan)  # warm: the steady state of a training loop
            expected = 4.0 if plan.src.partial_dims else 1.0  # every rank holds ones
            checked[i] = bool(
                result.shape == tuple(plan.dst.local_shape(plan.shape, rank)) and np.all(result == expected)
            )
            comm.all_gather_object(None)  # a barrier
            start = time.perf_counter()
            execute(plan)
            times[i].append(time.perf_counter() - start)
    everyone = comm.all_gather_object((times, checked))
    if rank == 0:
        rows = []
        for i, (name, nbytes, label, _) in enumerate(runs):
            per_rep = [max(t[i][rep] for t, _ in everyone) for rep in range(ROUNDS)]
            rows.append({"case": name, "nbytes": nbytes, "label": label, "seconds": summary(per_rep),
                         "correct": all(c[i] for _, c in everyone)})  # fmt: skip
        Path(out).write_text(json.dumps(rows))


def report_decompositions() -> bool:
    cluster = load_cluster("cpu-gloo")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "decompositions.json"
        run_processes(
            DECOMPOSITION_WORLD, [os.path.abspath(__file__), "--decomposition-worker", str(out)], timeout=1800
        )
        measured = {(r["case"], r["nbytes"], r["label"]): r for r in json.loads(out.read_text())}
    print(f"\nReshard decompositions on a 2 x 2 mesh, {DECOMPOSITION_WORLD} processes, host backend communicator "
          "(GlooCommunicator: world collectives native on gloo, sub-group steps as a world exchange); "
          f"lower quartile of {ROUNDS} reps of the slowest rank")  # fmt: skip
    print(f"{'case':>31} {'size':>7} {'plan':>23} {'measured':>10} {'predicted':>10} {'error':>7}  planner")
    all_right = True
    for case in CASES:
        for nbytes in DECOMPOSITION_SIZES:
            shape = (nbytes // 4 // 1024, 1024)
            found = candidate_plans(case, shape, cluster)
            cheapest = min(found["plans"], key=lambda label: measured[case[0], nbytes, label]["seconds"])
            for label, plan in found["plans"].items():
                row = measured[case[0], nbytes, label]
                error = (plan.time - row["seconds"]) / row["seconds"]
                mark = "chose" if label == found["chosen"] else ""
                wrong = "" if row["correct"] else "  WRONG RESULT"
                print(f"{case[0]:>31} {format_bytes(nbytes):>7} {label:>23} {format_time(row['seconds']):>10} "
                      f"{format_time(plan.time):>10} {100 * error:>6.1f}%  {mark}{wrong}")  # fmt: skip
                all_right &= row["correct"]
            right = cheapest == found["chosen"]
            all_right &= right
            print(f"{'':>31} {'':>7} the planner's choice ({found['chosen']}) was "
                  f"{'the measured-cheaper one' if right else 'NOT the measured-cheaper one (' + cheapest + ')'}")  # fmt: skip
    return all_right


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decomposition-worker", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-decompositions", action="store_true")
    parser.add_argument("--samples", help="write the accuracy samples (JSON) here")
    args = parser.parse_args(argv)
    if args.decomposition_worker:
        decomposition_worker(args.decomposition_worker)
        return
    start = time.perf_counter()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")
    if not args.skip_accuracy:
        worlds = (2, 4)
        samples = measure_accuracy(worlds)
        if args.samples:
            Path(args.samples).write_text(json.dumps([vars_of(s) for s in samples]))
        report_accuracy(samples, worlds)
    if not args.skip_decompositions:
        report_decompositions()
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
