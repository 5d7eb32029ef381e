"""Fit measured collective samples into a CPU profile (stage: cost model; what a calibration's
measurements become: ``cpu-gloo`` / ``cpu-shm``).

The measuring is no part of the installed cost model: ``tools/calibrate.py`` spawns the local
processes, times the collectives (:class:`Sample`: each size in :data:`ROUNDS` rounds, reduced
to the lower quartile of the reps, :func:`summary`) and the device, and calls
:func:`build_profile` / :func:`build_shm_profile` here, which fit per collective the latency
and bandwidth of the alpha-beta formula in :mod:`autopar.cost_model.comm` plus, where it lowers
the error, a knee at 32 MiB (from that size on the buffers are fresh memory: see
:class:`~autopar.cost_model.cluster.Link`), minimizing the mean absolute relative error over
both world sizes at once (so the fit keeps the formula's dependence on the group size), and per
world size (``all_reduce@4``: with 4 processes on 2 cores the processes contend for the cores,
which no link formula predicts; a group of that size uses its own fit). gloo has no
reduce_scatter and no all_to_all: the profile marks them *emulated*, priced as the all_reduce /
all_gather plus slice that runs instead.

Pure functions of their samples: this module imports no runtime, testing or inspection module
(``tests/unit/test_import_cycles.py::test_lower_layers_import_no_upper_layer``).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from autopar.collective_kinds import kind_of, priced_kinds
from autopar.cost_model.cluster import EMULATIONS, Cluster, Device, Link
from autopar.cost_model.comm import coefficients

# all_reduce, all_gather, broadcast, send_recv (gloo emulates the others) and the host backend's exchange
MEASURED = (*(k for k in priced_kinds() if kind_of(k).emulated_by is None), "exchange")
SHM_MEASURED = tuple(priced_kinds())  # every priced kind: the shared-memory communicator runs each
EMULATED = tuple(EMULATIONS)  # reduce_scatter, all_to_all: gloo has neither
CALIBRATION_SIZES = (6 << 10, 24 << 10, 96 << 10, 384 << 10, 1536 << 10, 6 << 20, 24 << 20, 40 << 20, 96 << 20)
ROUNDS = 6  # each size is timed in 6 rounds spread over the run (a burst of load hits one round)
KNEE = 32 << 20  # glibc's largest dynamic mmap threshold: every allocation this big is fresh memory
PROFILE_PATH = Path(__file__).parent / "profiles" / "cpu_gloo.json"
SHM_PROFILE_PATH = Path(__file__).parent / "profiles" / "cpu_shm.json"
DEVICE_SOURCE = (
    "peaks: numpy float32 512x512 matmul and a 32 MiB copy in one process, best of 7; memory = physical RAM; "
    "achieved: Paddle's static Executor on CPU in one process (tools/calibrate.py: measure_paddle_device): chains of 10 adds "
    "(the median bandwidth over 16 .. 64 MiB operands; "
    "cache_bandwidth: over those whose traffic fits the level-2 cache, cache_bytes), "
    "an add of 8 KiB and a tiny GPT block's training step per op (op_seconds: the larger), a one-op program's run "
    "(segment_seconds), each a difference of two programs, best of 5; matmul rate and kernel_seconds: the profiled "
    "training steps of a GPT block, Llama, ViT and MLP-Mixer (tools/kernel_rates.py); cores: os.cpu_count(), shared by "
    "the node's processes"
)


@dataclass(frozen=True, slots=True)
class Sample:
    """One measured collective: ``seconds`` for ``nbytes`` (comm.py's convention) over ``world`` ranks."""

    kind: str
    world: int
    nbytes: int
    seconds: float  # the lower quartile over reps of the slowest rank's time (see :func:`summary`)
    reps: tuple[float, ...] = field(default=(), compare=False)  # every rep's slowest-rank time


# ---- parent side -----------------------------------------------------------------------


def summary(reps: Sequence[float]) -> float:
    """The figure a set of reps is reduced to: their lower quartile. The machine may be shared
    (other processes only ever add time to a rep: a scheduler time slice is ~4 ms, more than a
    1 MiB collective takes), while the contention of 4 processes on 2 cores, which every rep
    sees, stays in."""
    return float(np.quantile(np.asarray(reps, dtype=float), 0.25))


def fit_links(samples: Sequence[Sample]) -> dict[str, Link]:
    """Per kind: one fit over every world size (``kind``) and one per world size (``kind@p``)."""
    fits = {}
    for kind in dict.fromkeys(s.kind for s in samples):
        fits[kind] = fit_link(samples, kind)
        for world in sorted({s.world for s in samples if s.kind == kind}):
            fits[f"{kind}@{world}"] = fit_link([s for s in samples if s.world == world], kind)
    return fits


def _formula(kind: str) -> str:
    return "all_gather" if kind == "exchange" else kind  # an exchange is an all_gather of pickled inputs


def fit_link(samples: Sequence[Sample], kind: str, knee: float = KNEE) -> Link:
    """Latency and bandwidth of ``kind``'s ring formula and, where it lowers the error, the
    bandwidth of a knee at ``knee`` bytes (from that size on the buffers are fresh memory:
    :class:`Link`). The fit minimizes the mean absolute *relative* error (the benchmark's
    measure; robust to the odd sample a burst of load slowed down): iteratively reweighted
    least squares, every figure kept >= 0."""
    rows = [s for s in samples if s.kind == kind and s.world > 1]
    design = np.array([(*coefficients(_formula(kind), s.world, s.nbytes), s.nbytes * (s.nbytes >= knee)) for s in rows])
    alpha, beta, gamma = _least_relative_error(design / np.array([[s.seconds] for s in rows]))
    bandwidth = 1.0 / max(beta, 1e-15)
    if gamma <= 0:
        return Link(latency=float(alpha), bandwidth=float(bandwidth))
    return Link(latency=float(alpha), bandwidth=float(bandwidth), knee=float(knee), knee_bandwidth=float(1.0 / gamma))


def _least_relative_error(scaled: np.ndarray) -> np.ndarray:
    """``argmin sum |scaled x - 1|`` over ``x >= 0`` by iteratively reweighted least squares."""
    weights = np.ones(len(scaled))
    for _ in range(100):
        figures = _nonnegative_lstsq(scaled * weights[:, None], weights)
        new = 1.0 / np.sqrt(np.maximum(np.abs(scaled @ figures - 1.0), 1e-4))  # sum w^2 r^2 = sum |r|
        if np.allclose(new, weights, rtol=1e-6):
            break
        weights = new
    return figures


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``argmin |a x - b|`` over ``x >= 0`` (a few columns: every subset of free columns tried)."""
    best, best_error = np.zeros(a.shape[1]), float(np.sum(b**2))
    for size in range(1, a.shape[1] + 1):
        for free in itertools.combinations(range(a.shape[1]), size):
            if not a[:, free].any(axis=0).all():
                continue
            x = np.zeros(a.shape[1])
            x[list(free)] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            error = float(np.sum((a @ x - b) ** 2))
            if (x >= 0).all() and error < best_error:
                best, best_error = x, error
    return best


def build_profile(samples: Sequence[Sample], worlds: Sequence[int], sizes: Sequence[int], device: Device) -> Cluster:
    """The ``cpu-gloo`` cluster from measured samples of the MEASURED kinds and the measured
    ``device`` (``tools/calibrate.py``: ``measure_paddle_device``)."""
    fits = fit_links([s for s in samples if s.kind in MEASURED])
    return Cluster(
        name="cpu-gloo", nodes=1, devices_per_node=8, intra=fits["all_reduce"], inter=fits["all_reduce"],
        device=device, collectives=tuple(sorted(fits.items())), emulated=EMULATED, tree=False,
        subgroups="world_exchange",
        sources=(
            ("collectives", f"fitted by tools/calibrate.py: gloo over loopback, {list(worlds)} processes, "
                            f"sizes {list(sizes)} bytes, each timed in {ROUNDS} rounds (lower quartile over reps of the slowest rank), "
                            "ring formulas, least absolute relative error; "
                            "kind@p: fitted on p processes only (used for groups of p: 4 processes on 2 cores contend)"),
            ("knee", f"{KNEE} bytes: glibc's largest dynamic mmap threshold; a buffer this big is fresh memory each call "
                     "(Paddle allocates collective outputs per call) and its 4 KiB pages fault in (3-6 us each here); "
                     "knee_bandwidth fitted per collective, absent where it does not lower the error"),
            ("exchange", "paddle.distributed.all_gather_object of a numpy array from every rank (what the host backend "
                         "does for a sub-group collective); nbytes = the gathered bytes, world x input"),
            ("subgroups", "world_exchange: gloo sub-groups deadlock with 4 processes (PADDLE_NOTES), the host backend "
                          "runs every sub-group collective as a world exchange"),
            ("intra", "the all_reduce fit; inter = intra (one host)"),
            ("emulated", "gloo has no reduce_scatter / all_to_all: all_reduce + slice, all_gather + slice"),
            ("device", DEVICE_SOURCE),
            ("devices_per_node", f"processes, not cores: the machine has {os.cpu_count() or 0} cores"),
        ),
    )  # fmt: skip


def build_shm_profile(
    samples: Sequence[Sample], worlds: Sequence[int], sizes: Sequence[int], device: Device
) -> Cluster:
    """The ``cpu-shm`` cluster: the host backend's shared-memory communicator, every kind
    native (reduce_scatter and all_to_all too) and any sub-group among its members only. A
    collective there is no ring: each member copies its input into its slot and reads every
    member's (``p`` inputs per rank); per world size (``kind@p``) that is still latency plus
    bytes over a bandwidth, which the ring formula's fit absorbs for that ``p``."""
    fits = fit_links([s for s in samples if s.kind in SHM_MEASURED])
    return Cluster(
        name="cpu-shm", nodes=1, devices_per_node=8, intra=fits["all_reduce"], inter=fits["all_reduce"],
        device=device, collectives=tuple(sorted(fits.items())), emulated=(), tree=False,
        subgroups="native",
        sources=(
            ("collectives", f"fitted by tools/calibrate.py --communicator shm: the host backend's "
                            f"shared-memory communicator (autopar.runtime.shm, SharedMemoryCommunicator.run), {list(worlds)} "
                            f"processes, sizes {list(sizes)} bytes, each timed in {ROUNDS} rounds (lower quartile over reps "
                            "of the slowest rank), ring formulas as the fitted form, least absolute relative error; "
                            "kind@p: fitted on p processes only (the copy-in / read-all algorithm's cost per byte grows "
                            "with p; 4 processes on 2 cores contend)"),
            ("knee", f"{KNEE} bytes: fresh memory for outputs this big (see cpu-gloo); fitted where it lowers the error"),
            ("subgroups", "native: a sub-group's members talk among themselves (shared-memory slots)"),
            ("intra", "the all_reduce fit; inter = intra (one host)"),
            ("device", DEVICE_SOURCE),
            ("devices_per_node", f"processes, not cores: the machine has {os.cpu_count() or 0} cores"),
        ),
    )  # fmt: skip


def vars_of(sample: Sample) -> dict:
    return asdict(sample)
